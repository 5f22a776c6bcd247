"""The files a job's data section names: how `data.paths` and `data.validation` expand, which documents the
per-file split holds out, and what `validate` checks about them. Torch- and numpy-free, so the loaders in
`seqtrain.data` and the spec's checks share one rule (and validate says before a run what the run would find).

Split rules (what the loaders do):
- `data.validation` named: it is the whole validation split and nothing of `data.paths` is held out;
- text: per file, by a hash of its path (`in_validation`); jsonl: per record, by a hash of `path:line`;
- raw token files: the last `validationFraction` of each file's tokens;
- prepare-data folders: per shard, the last `validationFraction` of its documents, or of its tokens when the
  shard holds too few documents for that (one large text is one document).
"""

from __future__ import annotations

import array
import glob
import hashlib
import os
import re
from collections.abc import Sequence

from seqtrain.spec.job import SeqTrainJob
from seqtrain.spec.problems import Problem

PREPARED_INDEX = "index.json"  # seqtrain.data.prepare.INDEX
RAW_SCAN_TOKENS = 1 << 20  # validate reads this many ids of each raw token file (about 2-4 MB)
JSONL_SCAN_BYTES = 256 << 20  # validate counts jsonl records up to this much text (the loader reads it all anyway)
# File names (without extension) that say "held-out data": nanoGPT's val.bin, valid.txt, wiki_validation.jsonl,
# and test/dev/eval only as the whole name (test_*.py in a code corpus is training data).
_HELD_OUT_NAME = re.compile(r"^((.*[_.-])?(val|valid|validation|heldout)([_.-].*)?|test|dev|eval)$")


def in_validation(name: str, fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(name) as a number in [0, 1), below fraction."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64
    return h < fraction


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(path), PREPARED_INDEX))


def expand(patterns: Sequence[str], field: str = "spec.data.paths", folders: bool = True) -> list[str]:
    """Sorted, de-duplicated files matched by the globs (`**` recursive); with folders, a folder stands for every
    file below it (names starting with '.' skipped). FileNotFoundError naming the field and pattern if none."""
    out: list[str] = []
    for pattern in patterns:
        path = os.path.expanduser(pattern)
        if folders and os.path.isdir(path):
            matches = _walk(path)
        else:
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise FileNotFoundError(f"{field}: {pattern!r} matches no file")
        out += matches
    return list(dict.fromkeys(out))


def _walk(folder: str) -> list[str]:
    out: list[str] = []
    for here, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        out += [os.path.join(here, f) for f in files if not f.startswith(".")]
    return sorted(out)


def _identity(path: str) -> tuple[int, int] | str:
    """What makes two names the same file or folder: device and inode (hard links too), else the real path."""
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return os.path.realpath(path)


def _entries(job: SeqTrainJob, patterns: Sequence[str], field: str) -> dict[tuple[int, int] | str, str]:
    """identity -> the name as the user wrote it (or as its glob/folder expanded) for one list of data paths."""
    source = job.spec.data.source
    out: dict[tuple[int, int] | str, str] = {}
    for pattern in patterns:
        if "://" in pattern:
            continue
        if source == "tokens" and is_prepared(pattern):
            out[_identity(os.path.expanduser(pattern))] = pattern
            continue
        try:
            files = expand([pattern], field, folders=source != "tokens")
        except FileNotFoundError:
            continue  # reported as "matches no file"
        for f in files:
            out[_identity(f)] = f
    return out


def data_problems(job: SeqTrainJob, readable: bool, vocab: int | None = None) -> list[Problem]:
    """data.validation's rules, splits that would leave the run without training or validation data, and raw
    token files holding ids the model's vocabulary (`vocab`, resolved) does not have."""
    d = job.spec.data
    out: list[Problem] = _chat_problems(job, readable)
    if readable and vocab is not None and d.source == "tokens":
        out += _raw_id_problems(job, vocab)
    if d.validation is not None:
        if d.source not in ("text", "jsonl", "tokens"):
            out.append(Problem("spec.data.validation", f"applies to source text, jsonl and tokens, not {d.source}; "
                                                       "remove it"))
            return out
        if not d.validation:
            out.append(Problem("spec.data.validation", "name at least one file, glob or folder, or remove it"))
        # compared with the default, not "was it set": a resolved job written to a run folder sets every field
        if d.validation_fraction != type(d).model_fields["validation_fraction"].default:
            out.append(Problem("spec.data.validationFraction", "data.validation names the validation data, so "
                                                               "nothing of data.paths is held out; remove it"))
    if not readable or d.source not in ("text", "jsonl", "tokens") or not d.paths:
        return out
    if d.source == "tokens":  # raw token files are listed one by one: a folder of them also holds meta.pkl & co.
        out += [Problem(field, f"{p!r} is a folder but not one written by `seqtrain prepare-data` (no index.json); "
                               "list its token files, e.g. .../train.bin")
                for field, entries in (("spec.data.paths", d.paths), ("spec.data.validation", d.validation or []))
                for p in entries if os.path.isdir(os.path.expanduser(p)) and not is_prepared(p)]
    if d.validation:
        missing = [p for p in d.validation if "://" not in p and not is_prepared(p)
                   and not glob.glob(os.path.expanduser(p)) and not os.path.isdir(os.path.expanduser(p))]
        out += [Problem("spec.data.validation", f"{p!r} matches no file") for p in missing]
        if d.source == "tokens":
            kinds = {is_prepared(p) for p in d.validation if "://" not in p}
            if len(kinds) > 1:
                out.append(Problem("spec.data.validation", "mixes `seqtrain prepare-data` folders and raw token "
                                                           "files; list only one kind"))
        train = _entries(job, d.paths, "spec.data.paths")
        for key, name in _entries(job, d.validation, "spec.data.validation").items():
            if key in train:
                out.append(Problem("spec.data.validation", f"{name!r} is also training data (data.paths: "
                                                           f"{train[key]!r}); remove it from one of the two"))
        return out
    return out + _split_problems(job)


def _chat_problems(job: SeqTrainJob, readable: bool) -> list[Problem]:
    """data.format chat: jsonl lines of messages, a tokenizer file, and (where readable) its chat template."""
    d = job.spec.data
    if d.format != "chat":
        return []
    if d.source == "tokens":
        return [Problem("spec.data.format", "a prepared folder carries its own format (`seqtrain prepare-data "
                                            "--format chat` writes the assistant mask beside its shards); remove "
                                            "data.format")]
    if d.source != "jsonl":
        return [Problem("spec.data.format", f"chat reads jsonl lines of messages, not source {d.source}; set "
                                            "data.source jsonl (or data.format text)")]
    from seqtrain.spec.chat_template import template_of
    from seqtrain.spec.data import TokenizerSpec
    from seqtrain.spec.init_source import folder_tokenizer, local_folder

    refuse = [Problem("spec.data.format", "chat needs a tokenizer with a chat template: start from a model.init "
                                          "folder that holds tokenizer.json, or set data.tokenizer {type: file, "
                                          "path: .../tokenizer.json}")]
    tok = d.tokenizer
    if tok.type == "byte":
        init = job.spec.model.init
        if not init:
            return refuse
        if not readable:
            return []  # the model.init folder's tokenizer is read where the folder is (the trainer's pod)
        # The model.init folder's tokenizer when data.tokenizer is unset (as resolve.init_tokenizer gives it: that
        # module imports this one, so the rule for a jsonl source is read here directly).
        own = folder_tokenizer(init) if "tokenizer" not in d.model_fields_set and \
            not ("://" in init and not init.startswith("hf://")) else None
        if own:
            tok = TokenizerSpec(type="file", path=own)
        else:
            try:
                here = os.path.isdir(local_folder(init))
            except ValueError:
                here = False  # model.init's own check says why
            return refuse if here else []
    if not tok.path:
        return refuse
    path = os.path.expanduser(tok.path)
    if readable and os.path.isfile(path):
        try:
            template_of(path)
        except ValueError as exc:
            return [Problem("spec.data.format", str(exc).removeprefix("spec.data.format: "))]
    return []


def _split_problems(job: SeqTrainJob) -> list[Problem]:
    """Without data.validation: would the per-file split leave a side empty? (What the loaders would raise.)"""
    d = job.spec.data
    f = d.validation_fraction
    evaluates = job.spec.training.eval.batches > 0
    fix = ("name held-out files in data.validation (e.g. data.validation: [val.txt]) or list more files in "
           "data.paths")
    if d.source == "text":
        try:
            files = expand(d.paths)
        except FileNotFoundError:
            return []
        val = [p for p in files if in_validation(p, f)]
        if len(val) == len(files):
            return [Problem("spec.data.paths", f"every file falls into the validation split (validationFraction "
                                               f"{f}, chosen per file by a hash of its path); {fix}")]
        if evaluates and not val:
            return [Problem("spec.data.validation", f"none of the {len(files)} file(s) of data.paths falls into "
                                                    f"the validation split (validationFraction {f}, chosen per file "
                                                    f"by a hash of its path), and training.eval needs one; {fix}")]
    elif d.source == "jsonl" and evaluates:
        try:
            files = expand(d.paths)
        except FileNotFoundError:
            return []
        try:
            if sum(os.path.getsize(p) for p in files) > JSONL_SCAN_BYTES:
                return []
            lines = {p: _record_lines(p) for p in files}
        except OSError:
            return []  # unreadable here: the loader names the file
        if not any(in_validation(f"{p}:{n}", f) for p in files for n in lines[p]):
            return [Problem("spec.data.validation", f"no jsonl record falls into the validation split "
                                                    f"(validationFraction {f}, per record by a hash of file:line), "
                                                    f"and training.eval needs one; name held-out files in "
                                                    "data.validation or raise data.validationFraction")]
    elif d.source == "tokens" and evaluates and f == 0:
        return [Problem("spec.data.validation", "validationFraction 0 holds nothing out and training.eval needs "
                                                "validation data; name it in data.validation or raise "
                                                "data.validationFraction")]
    return []


def _raw_id_problems(job: SeqTrainJob, vocab: int) -> list[Problem]:
    """The largest id in the first RAW_SCAN_TOKENS of each raw token file against the model's vocabulary: raw
    files carry no vocabulary (nanoGPT's GPT-2 train.bin holds ids up to 50256), and an id past the embedding fails
    only inside the first step. A cheap guard (a prefix), not a proof."""
    d = job.spec.data
    code = "H" if d.token_dtype == "uint16" else "I"
    out = []
    for entries, field in ((d.paths, "spec.data.paths"), (d.validation or [], "spec.data.validation")):
        for pattern in entries:
            if "://" in pattern or is_prepared(pattern):
                continue
            try:
                files = expand([pattern], field, folders=False)
            except FileNotFoundError:
                continue
            for f in files:
                ids = array.array(code)
                try:
                    with open(f, "rb") as fh:
                        chunk = fh.read(RAW_SCAN_TOKENS * ids.itemsize)
                except OSError:
                    continue  # unreadable here: the loader names the file
                ids.frombytes(chunk[:len(chunk) - len(chunk) % ids.itemsize])
                top = max(ids) if ids else 0
                if top >= vocab:
                    out.append(Problem("spec.model.vocabSize", f"{vocab} ids, but {f!r} holds id {top}: raw token "
                                                               f"files carry no vocabulary; set model.vocabSize to "
                                                               f"at least {top + 1} (nanoGPT: meta.pkl's vocab_size)"))
                    return out
    return out


def _record_lines(path: str) -> list[int]:
    """Line numbers (from 1) of a jsonl file's non-blank lines: the loader's record names are `path:line`."""
    with open(path, "rb") as f:
        return [n for n, line in enumerate(f, start=1) if line.strip()]


def data_notes(job: SeqTrainJob, readable: bool) -> list[str]:
    """Warnings that are not errors: a training file named like held-out data (nanoGPT's val.bin listed in
    data.paths is mostly trained on; the per-file split holds out only a slice of it, or nothing)."""
    d = job.spec.data
    if not readable or d.validation or d.source not in ("text", "jsonl", "tokens"):
        return []
    names = []
    for p in d.paths:
        if "://" in p:
            continue
        try:
            files = [p] if d.source == "tokens" and is_prepared(p) else expand([p], folders=d.source != "tokens")
        except FileNotFoundError:
            continue
        names += [f for f in files if _HELD_OUT_NAME.match(os.path.splitext(os.path.basename(f.rstrip("/")))[0].lower())
                  and not (d.source == "text" and in_validation(f, d.validation_fraction))]
    if not names:
        return []
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [f"data.paths lists {shown}, named like held-out data, as training data; name validation data in "
            f"data.validation to keep it out of training"]
