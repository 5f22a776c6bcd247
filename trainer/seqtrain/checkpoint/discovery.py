"""Finding complete checkpoints. Torch-free: the controller uses it to report and pick the resume step.

A checkpoint is complete when `<dir>/step-<N>/meta.json` parses, names step N, every file it lists exists and, when
it records `sizes` (every file's byte count at publish time), every file still has that size (a truncated or
replaced file is caught before anything is loaded). Nothing in a checkpoint folder is followed through a symbolic
link: a link anywhere in it makes it unusable. `sha256` (every file's hash at publish time) is checked by
`verify_hashes` before a resume loads it (rank 0 only: reading every byte is too slow for listings); a same-size
bit flip is caught there. `.tmp-*` folders (a save in progress or cut by a crash) and
folders without meta.json are never used. A checkpoint the trainer found unusable is renamed `.bad-step-N/` with a
`REASON` file (see `quarantined`), so it is never picked again and stays there for inspection.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
DELETE_PREFIX = ".del-step-"
BAD_PREFIX = ".bad-step-"
REASON_FILE = "REASON"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
KEEP_BAD = 3  # `.bad-step-*` folders kept for inspection; older ones are pruned


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def time(self) -> str | None:
        value = self.meta.get("time")
        return value if isinstance(value, str) else None  # meta.json is the storage's: any JSON may stand there


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, f"{STEP_PREFIX}{step}")


MAX_DEPTH = 32  # folders inside a checkpoint: engines write one level (state/)


class TooDeep(Exception):
    """A folder nested deeper than MAX_DEPTH inside a checkpoint."""


def _walk(path: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """(folder, subfolder names, other names) of every folder at or under `path`, like os.walk without following
    links, but iterative and bounded: a folder nested thousands deep raises TooDeep, not RecursionError (os.walk
    recurses). Links, to folders too, are among the other names. Unreadable folders are skipped, as os.walk does."""
    stack = [(path, 0)]
    while stack:
        root, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TooDeep(root)
        dirs: list[str] = []
        names: list[str] = []
        try:
            with os.scandir(root) as entries:
                for entry in entries:
                    (dirs if entry.is_dir(follow_symlinks=False) else names).append(entry.name)
        except OSError:
            continue
        yield root, dirs, names
        stack.extend((os.path.join(root, d), depth + 1) for d in reversed(sorted(dirs)))


def remove_tree(path: str) -> None:
    """`shutil.rmtree(path, ignore_errors=True)` for a folder of any depth: Python 3.11's rmtree recurses, so a
    checkpoint folder planted with thousands of nested folders would end pruning in RecursionError. Past that, each
    folder's subfolders are moved up into one holding folder beside it (paths stay short) and removed from there."""
    import shutil

    try:
        shutil.rmtree(path, ignore_errors=True)
        return
    except RecursionError:
        pass
    holding, count, queue = f"{path}.rm-{os.getpid()}", 0, [path]
    with contextlib.suppress(OSError):
        os.mkdir(holding)
    while queue:
        folder = queue.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    count += 1
                    os.rename(entry.path, os.path.join(holding, str(count)))
                    queue.append(os.path.join(holding, str(count)))
                else:
                    os.unlink(entry.path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    with contextlib.suppress(OSError):
        os.rmdir(holding)


def _files(path: str) -> list[str]:
    """Every file under `path` (relative names, meta.json excepted), links not followed."""
    out = []
    for root, _, names in _walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel != META_FILE:
                out.append(rel)
    return sorted(out)


def file_sizes(path: str) -> dict[str, int]:
    """Every regular file under `path` (relative name -> bytes), meta.json excepted: recorded at publish time."""
    return {rel: os.path.getsize(os.path.join(path, rel)) for rel in _files(path)}


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_hashes(path: str) -> dict[str, str]:
    """Every file under `path` (relative name -> sha256 hex), meta.json excepted: recorded at publish time."""
    return {rel: sha256_of(os.path.join(path, rel)) for rel in _files(path)}


def symlink_in(path: str) -> str | None:
    """The first symbolic link at or under `path` (the folder itself included), or None."""
    if os.path.islink(path):
        return path
    for root, dirs, names in _walk(path):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                return os.path.join(root, name)
    return None


META_MAX_BYTES = 64 << 20  # a meta.json lists every file with its size and hash: far below this


class MetaError(ValueError):
    """A meta.json that is not a JSON object (unparsable, too large or too deep): the message names the file."""


def read_meta(meta_path: str) -> dict[str, Any]:
    """A checkpoint's meta.json as a dict; MetaError for anything else (an OSError propagates: missing, or the
    storage's fault). Bounded: a huge file is not read whole, a deeply nested one is not followed down."""
    with open(meta_path, "rb") as f:
        raw = f.read(META_MAX_BYTES + 1)
    if len(raw) > META_MAX_BYTES:
        raise MetaError(f"{meta_path}: larger than {META_MAX_BYTES >> 20} MiB (not a checkpoint's meta.json)")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser follows
        why = (str(exc).splitlines() or [type(exc).__name__])[0][:160]
        raise MetaError(f"{meta_path}: not JSON ({why})") from None
    if not isinstance(meta, dict):
        raise MetaError(f"{meta_path}: not a JSON object")
    return meta


def _contained(path: str, name: str) -> bool:
    """`name` (from meta.json) stays inside `path`: relative, no `..`."""
    norm = os.path.normpath(name)
    return not os.path.isabs(norm) and norm != ".." and not norm.startswith(".." + os.sep)


def problem(path: str, require_step_name: bool = True) -> str | None:
    """Why the checkpoint at `path` (a published step-N folder with meta.json) cannot be used, or None."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if require_step_name and not m:
        return f"{path}: not a step-N folder"
    try:
        link = symlink_in(path)
    except TooDeep as exc:
        return f"{str(exc)[:300]}: folders nested more than {MAX_DEPTH} deep inside a checkpoint"
    if link is not None:
        return f"{link}: a symbolic link inside a checkpoint (never followed; replace it with the file itself)"
    meta_path = os.path.join(path, META_FILE)
    try:
        meta = read_meta(meta_path)
    except OSError:
        return f"{meta_path}: missing (not published)"
    except MetaError as exc:
        return str(exc)
    if m is not None and meta.get("step") != int(m.group(1)):
        return f"{meta_path}: does not describe step {m.group(1) if m else '?'}"
    files = meta.get("files", [])
    # entries may be folders: every engine writes its DCP shards into state/
    if not isinstance(files, list):
        return f"{meta_path}: `files` is not a list"
    for name in files:
        if not isinstance(name, str):
            return f"{meta_path}: a `files` entry is a {type(name).__name__}, not a file name"
        if not _contained(path, name):
            return f"{meta_path}: file entry {name[:200]!r} points outside the checkpoint folder"
        if not os.path.exists(os.path.join(path, name)):
            return f"{_shown(os.path.join(path, name[:200]))}: missing"
    sizes = meta.get("sizes")
    if isinstance(sizes, dict):
        for name, size in sorted(sizes.items()):
            if not _contained(path, name):
                return f"{meta_path}: file entry {name[:200]!r} points outside the checkpoint folder"
            full = os.path.join(path, name)
            try:
                actual = os.path.getsize(full)
            except (OSError, ValueError):  # ValueError: a NUL in the name
                return f"{_shown(full[:300])}: missing"
            if actual != size:
                said = size if isinstance(size, int) else f"a {type(size).__name__}"
                return f"{_shown(full[:300])}: {actual} bytes, but {said} when it was saved (truncated or replaced)"
    return None


def _shown(path: str) -> str:
    """A path built from a meta.json name, fit for a one-line message: the names are the checkpoint's (anyone who
    can write the volume), so a control character in one (a newline, a carriage return) is escaped, not printed."""
    return path if path.isprintable() else repr(path)


def verify_hashes(path: str) -> str | None:
    """Why the files of checkpoint `path` differ from the sha256 its meta.json recorded at publish time (a bit
    flip, a replaced file), or None (also for checkpoints published before hashes were recorded). An I/O error
    while reading propagates: that is the storage's fault, not the checkpoint's."""
    try:
        hashes = read_meta(os.path.join(path, META_FILE)).get("sha256")
    except MetaError as exc:
        return str(exc)
    if not isinstance(hashes, dict):
        return None
    for name, want in sorted(hashes.items()):
        if not isinstance(want, str):
            return f"{os.path.join(path, META_FILE)}: sha256 of {str(name)[:80]!r} is not a hex string"
        if not _contained(path, name):
            return f"{os.path.join(path, META_FILE)}: file entry {name[:200]!r} points outside the checkpoint folder"
        full = os.path.join(path, name)
        try:
            got = sha256_of(full)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError):  # ValueError: a NUL
            return f"{_shown(full[:300])}: missing"
        if got != want:
            return f"{_shown(full[:300])}: sha256 {got[:12]}... but {str(want)[:12]}... when it was saved (corrupt or replaced)"
    return None


def read_complete(path: str) -> CheckpointInfo | None:
    """The checkpoint at `path` if it is complete, else None."""
    if problem(path) is not None:
        return None
    try:
        meta = read_meta(os.path.join(path, META_FILE))
    except (OSError, MetaError):  # replaced since `problem` read it
        return None
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    assert m is not None
    return CheckpointInfo(step=int(m.group(1)), path=path, meta=meta)


def published(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every published step-N folder (meta.json present, usable or not), oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := _STEP_DIR.match(n))]
    return sorted((s, p) for s, p in out if os.path.exists(os.path.join(p, META_FILE)))


def quarantined(directory: str) -> list[tuple[int, str]]:
    """(step, reason) of the checkpoints the trainer set aside as unusable (`.bad-step-N/REASON`), oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    out = []
    for n in names:
        if n.startswith(BAD_PREFIX) and n[len(BAD_PREFIX):].isdigit():
            path = os.path.join(directory, n, REASON_FILE)
            try:
                if os.path.islink(path):  # never read through a link planted there (its target would be reported)
                    raise OSError("a link")
                with open(path, encoding="utf-8") as f:
                    reason = f.read(2000).strip()
            except (OSError, ValueError):
                reason = "unusable (no REASON file)"
            out.append((int(n[len(BAD_PREFIX):]), reason))
    return sorted(out)


def list_checkpoints(directory: str) -> list[CheckpointInfo]:
    """Complete checkpoints under `directory`, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = [read_complete(os.path.join(directory, n)) for n in names if _STEP_DIR.match(n)]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def latest_checkpoint(directory: str) -> CheckpointInfo | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def latest_step(directory: str) -> int:
    """Step of the latest complete checkpoint, 0 when there is none."""
    c = latest_checkpoint(directory)
    return c.step if c else 0
