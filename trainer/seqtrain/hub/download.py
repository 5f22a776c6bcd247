"""Download `hf://ORG/NAME[@REVISION]` from the Hugging Face hub into a folder, once: what the job's init container
runs (`python -m seqtrain.hub hf://ORG/NAME@REV --root DIR`) so that every rank reads the model from the volume.

The hub's file API, as huggingface_hub speaks it (endpoint $HF_ENDPOINT, default https://huggingface.co):
    GET {endpoint}/api/models/{repo}/revision/{revision}?blobs=true   -> {"sha": commit, "siblings": [{"rfilename",
                                                                         "size", "blobId", "lfs": {"sha256",
                                                                         "size"}}, ...]}
    GET {endpoint}/{repo}/resolve/{commit}/{file}                     -> the file (LFS files redirect to a CDN)
A token ($HF_TOKEN) goes as `Authorization: Bearer`, and only to the endpoint's host (never to a redirect's CDN).

Bounded: the files seqtrain reads (top-level config/tokenizer JSON, safetensors, templates, vocabularies; not the
duplicate .bin/.pth/.gguf weights or sub-folders), a size cap per file and in all (and the disk's free space), a
timeout per request and a few retries with backoff (resuming a partial file with a Range request). Checked: sizes
and the LFS sha256 (other files: their git blob id) as the listing gives them; a file name that would leave the folder is refused, as is a redirect to
anything but http(s). Atomic: files land in `<dest>.partial`, a marker file is written last, then the folder is
renamed to `<dest>`; a folder with the marker is complete and is not downloaded again. A lock file serialises the
pods of one job that start together (the first downloads, the others find the marker).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import json
import os
import posixpath
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

DEFAULT_ENDPOINT = "https://huggingface.co"
MARKER = ".seqtrain-download.json"  # written last: its presence means the folder is complete
LOCK = ".seqtrain-download.lock"
# What seqtrain reads from a model folder (export/weights.py takes safetensors only); everything else is skipped.
WANTED = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
MAX_FILE_BYTES = 1 << 40  # 1 TiB: no single shard is larger
MAX_TOTAL_BYTES = 4 << 40
MAX_LISTING_BYTES = 64 << 20  # the revision's JSON (a repository of a few thousand files is a few MB)
MAX_FILES = 10_000
TIMEOUT_S = 60.0  # per connection attempt and per read
RETRIES = 5
CHUNK = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubError(RuntimeError):
    """A download that cannot be done: one line saying why and what to do."""


@dataclass(frozen=True)
class HubModel:
    repo: str  # ORG/NAME
    revision: str  # branch, tag or commit ("main" when the URI names none)

    @classmethod
    def parse(cls, uri: str) -> HubModel:
        if not uri.startswith("hf://"):
            raise HubError(f"{uri!r} is not hf://ORG/NAME[@REVISION]")
        name, _, rev = uri[len("hf://"):].partition("@")
        parts = name.split("/")
        if len(parts) != 2 or not all(_NAME.match(p) and ".." not in p for p in parts):
            raise HubError(f"{uri!r} is not hf://ORG/NAME[@REVISION] (letters, digits, '.', '_', '-')")
        rev = rev or "main"
        if any(c in rev for c in "\\\0") or ".." in rev.split("/") or rev.startswith("/") or len(rev) > 256:
            raise HubError(f"{uri!r}: revision {rev!r} is not a branch, tag or commit")
        return cls(name, rev)

    def folder(self, root: str) -> str:
        """Where this model lands below `root`: ORG--NAME/<revision, quoted> (seqtrain.spec.init_source reads it)."""
        org, name = self.repo.split("/")
        return os.path.join(root, f"{org}--{name}", urllib.parse.quote(self.revision, safe=""))


class _SameHostAuth(urllib.request.HTTPRedirectHandler):
    """Follow redirects to http(s) only; the token stays with the host it was given for."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,  # noqa: ANN401
                         newurl: str) -> urllib.request.Request | None:
        if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
            raise HubError(f"the hub redirected {req.full_url} to {newurl!r}, not an http(s) address")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


class Hub:
    def __init__(self, endpoint: str | None = None, token: str | None = None, timeout: float = TIMEOUT_S,
                 retries: int = RETRIES, sleep: Callable[[float], None] = time.sleep) -> None:
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        if urllib.parse.urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise HubError(f"HF_ENDPOINT {self.endpoint!r} is not an http(s) address")
        self.token = token if token is not None else (os.environ.get("HF_TOKEN") or None)
        self.timeout, self.retries, self.sleep = timeout, retries, sleep
        self._open = urllib.request.build_opener(_SameHostAuth()).open

    def _request(self, url: str, extra: dict[str, str] | None = None) -> urllib.request.Request:
        req = urllib.request.Request(url, headers={"User-Agent": "seqtrain-hub", **(extra or {})})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        return req

    def _retrying(self, what: str, attempt: Callable[[], Any]) -> Any:  # noqa: ANN401
        """attempt() with retries on connection errors, timeouts and 5xx/429; 4xx answers are final."""
        for i in range(self.retries + 1):
            try:
                return attempt()
            except urllib.error.HTTPError as exc:
                if exc.code in (401, 403):
                    raise HubError(f"{what}: the hub answered {exc.code}; the model is gated or private: accept its "
                                   "licence on the hub and give a token that may read it (HF_TOKEN; in a job: the "
                                   "hub token Secret)") from None
                if exc.code == 404:
                    raise HubError(f"{what}: not found on {self.endpoint} (404); check ORG/NAME and the revision") \
                        from None
                if exc.code != 429 and exc.code < 500 or i == self.retries:
                    raise HubError(f"{what}: the hub answered {exc.code} {exc.reason}") from None
            except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:  # timeouts, resets, cut-offs
                if i == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise HubError(f"{what}: {reason} after {self.retries + 1} attempts; can the pods reach "
                                   f"{self.endpoint}? (HF_ENDPOINT names a mirror)") from None
            self.sleep(min(30.0, 2.0 ** i))
        raise AssertionError("unreachable")

    def listing(self, model: HubModel) -> tuple[str, list[dict[str, Any]]]:
        """(commit, siblings) of the revision."""
        url = (f"{self.endpoint}/api/models/{model.repo}/revision/"
               f"{urllib.parse.quote(model.revision, safe='')}?blobs=true")

        def get() -> Any:  # noqa: ANN401
            with self._open(self._request(url), timeout=self.timeout) as r:
                body = r.read(MAX_LISTING_BYTES + 1)
            if len(body) > MAX_LISTING_BYTES:
                raise HubError(f"{url}: the file list is larger than {MAX_LISTING_BYTES >> 20} MiB")
            try:
                return json.loads(body)
            except ValueError:
                raise HubError(f"{url}: not the hub's JSON file list; is HF_ENDPOINT a Hugging Face hub?") from None

        info = self._retrying(f"hf://{model.repo}@{model.revision}", get)
        sha, siblings = info.get("sha") if isinstance(info, dict) else None, \
            info.get("siblings") if isinstance(info, dict) else None
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{40}", sha) or not isinstance(siblings, list):
            raise HubError(f"{url}: the answer has no commit sha and file list; is HF_ENDPOINT a Hugging Face hub?")
        if len(siblings) > MAX_FILES:
            raise HubError(f"hf://{model.repo}: {len(siblings)} files, more than {MAX_FILES}")
        return sha, [s for s in siblings if isinstance(s, dict)]

    def fetch(self, model: HubModel, commit: str, name: str, dest: str, size: int | None, sha256: str | None,
              cap: int, blob_id: str | None = None) -> int:
        """One file to `dest` (resuming a partial one); its size, checked against the listing and `cap`."""
        url = f"{self.endpoint}/{model.repo}/resolve/{commit}/{urllib.parse.quote(name)}"

        def get() -> int:
            have = os.path.getsize(dest) if os.path.isfile(dest) else 0
            if size is not None and have > size:
                have = 0
            if size is not None and have == size and have:
                return have
            req = self._request(url, {"Range": f"bytes={have}-"} if have else None)
            with self._open(req, timeout=self.timeout) as r:
                append = have > 0 and r.status == 206
                n = have if append else 0
                with open(dest, "ab" if append else "wb") as f:
                    while chunk := r.read(CHUNK):
                        n += len(chunk)
                        if n > cap or (size is not None and n > size):
                            raise HubError(f"hf://{model.repo}: {name} is larger than "
                                           f"{size if size is not None else cap} bytes")
                        f.write(chunk)
            if size is not None and n != size:
                raise ConnectionError(f"{name}: {n} of {size} bytes")  # cut off: retried, resumed
            return n

        n = self._retrying(f"hf://{model.repo}: {name}", get)
        # LFS files by their content's sha256; the others by git's blob id: sha1 of "blob <size>\0" + content
        want, h = (sha256, hashlib.sha256()) if sha256 is not None else (blob_id, hashlib.sha1(f"blob {n}\0".encode()))
        if want is not None:
            with open(dest, "rb") as f:
                while chunk := f.read(CHUNK):
                    h.update(chunk)
            if h.hexdigest() != want:
                os.remove(dest)
                kind = "sha256" if sha256 is not None else "git blob id"
                raise HubError(f"hf://{model.repo}: {name} does not have the {kind} the hub lists; run the job again")
        return n


def safe_name(name: Any) -> str:  # noqa: ANN401 - a JSON value from the server
    """A listed file name, refused (HubError) unless it is a relative path that stays inside the folder."""
    if not isinstance(name, str) or not name or len(name) > 1024 or "\\" in name or "\0" in name \
            or name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")) \
            or posixpath.normpath(name) != name:
        raise HubError(f"the hub listed a file named {name!r}, which would leave the download folder; refused")
    return name


def wanted(name: str) -> bool:
    return "/" not in name and not name.startswith(".") and any(fnmatch.fnmatch(name, p) for p in WANTED)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on `path` where the filesystem has one (flock: local disks, NFSv4); else none."""
    with open(path, "a") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(4096)
    except OSError:
        return None


def complete(folder: str, model: HubModel) -> bool:
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            done = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(done, dict) and done.get("repo") == model.repo and done.get("revision") == model.revision


def download(uri: str, root: str, hub: Hub | None = None, max_total: int = MAX_TOTAL_BYTES,
             max_file: int = MAX_FILE_BYTES, log: Callable[[str], None] = print) -> str:
    """The folder of `uri` below `root`, downloaded unless complete already. HubError on any refusal."""
    model = HubModel.parse(uri)
    dest = model.folder(root)
    if complete(dest, model):
        log(f"{uri}: complete in {dest}, nothing to download")
        return dest
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with _locked(dest + LOCK):
        if complete(dest, model):  # another pod of the job finished while this one waited
            log(f"{uri}: complete in {dest}, nothing to download")
            return dest
        hub = hub or Hub()
        commit, siblings = hub.listing(model)
        files: list[tuple[str, int | None, str | None, str | None]] = []
        for s in siblings:
            name = safe_name(s.get("rfilename"))
            if not wanted(name):
                continue
            lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
            size = lfs.get("size", s.get("size"))
            size = size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None
            sha = lfs.get("sha256") if isinstance(lfs.get("sha256"), str) else None
            if size is not None and size > max_file:
                raise HubError(f"{uri}: {name} is {size} bytes, more than the {max_file}-byte cap per file")
            blob = s.get("blobId") if not lfs and isinstance(s.get("blobId"), str) else None
            files.append((name, size, sha, blob if blob and re.fullmatch(r"[0-9a-f]{40}", blob) else None))
        if not any(n == "config.json" for n, _, _, _ in files):
            raise HubError(f"{uri}: revision {commit[:12]} has no config.json at its top level: not a transformers "
                           "model folder")
        known = sum(s or 0 for _, s, _, _ in files)
        if known > max_total:
            raise HubError(f"{uri}: {known} bytes to download, more than the {max_total}-byte cap")
        partial = dest + ".partial"
        stamp = os.path.join(partial, ".seqtrain-commit")
        if os.path.isdir(partial) and _read(stamp) != commit:
            shutil.rmtree(partial)  # an earlier attempt's files of another commit (the branch moved): not resumed
        os.makedirs(partial, exist_ok=True)
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(commit)
        free = shutil.disk_usage(partial).free + sum(
            os.path.getsize(os.path.join(partial, n)) for n, _, _, _ in files if os.path.isfile(os.path.join(partial, n)))
        if known > free:
            raise HubError(f"{uri}: {known} bytes to download but the volume at {root} has {free} free; give the "
                           "checkpoint volume more room")
        total = 0
        for name, size, sha, blob in files:
            total += hub.fetch(model, commit, name, os.path.join(partial, name), size, sha,
                               min(max_file, max_total - total), blob)
            log(f"{uri}: {name} ({total / 2**20:.1f} MiB so far)")
        with open(os.path.join(partial, MARKER + ".tmp"), "w", encoding="utf-8") as f:
            json.dump({"repo": model.repo, "revision": model.revision, "commit": commit, "endpoint": hub.endpoint,
                       "files": {n: os.path.getsize(os.path.join(partial, n)) for n, _, _, _ in files}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(partial, MARKER + ".tmp"), os.path.join(partial, MARKER))
        if os.path.isdir(dest):  # an incomplete folder of an older attempt (no marker): replaced
            shutil.rmtree(dest)
        os.rename(partial, dest)
        log(f"{uri}: {len(files)} files, {total / 2**20:.1f} MiB, commit {commit} in {dest}")
        return dest
