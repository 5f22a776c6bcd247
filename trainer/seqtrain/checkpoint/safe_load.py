"""THE loader for every pickle seqtrain reads (checkpoints, model folders): tensors and plain values only.

Files in a checkpoint folder may come from anyone who can write the storage (a shared PVC, a downloaded run), so
no file may run code when it is loaded. Every unpickling in seqtrain goes through this module:
- `load_plain`: seqtrain's own files (`engine*.pt`, `trainer.pt`, `rng-rank*.pt`, `scheduler.pt`), with
  `torch.load(weights_only=True)`, always onto the CPU first (the caller copies into its own device, so a resume
  never needs a second full copy of the state in GPU memory);
- `restricted_loads()`: while a library loads its own files (DeepSpeed's `zero/*.pt`, DCP's byte items), every
  `torch.load` it makes is held to weights_only=True with `LIBRARY_GLOBALS`, the few plain classes those
  libraries pickle (loss scaler, ZeRO stage enum, fragment addresses), whatever `weights_only` it asked for;
- `SafeFileSystemReader`: DCP's `.metadata` (a raw pickle) through an Unpickler that builds only the
  `torch.distributed.checkpoint` metadata classes, torch sizes/dtypes and plain containers.
A file that names anything else (a planted payload) is refused before anything of it runs: `UnusableCheckpoint`
naming the file. Errors are told apart: `UnusableCheckpoint` is the file's fault (refused, truncated, corrupt: the
trainer sets the checkpoint aside and falls back to the previous one); `CheckpointUnavailable` is this moment's
(out of memory, a CUDA error, an I/O error such as EIO, ENOSPC or a timeout of the storage): the checkpoint is
kept and the rank exits CHECKPOINT_UNAVAILABLE, which the controller retries as an infrastructure failure.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import pickle
import re
import sys
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from seqtrain.runtime.exitcodes import InvalidConfig


class UnusableCheckpoint(Exception):
    """A checkpoint file that must not (unsafe) or cannot (corrupt) be loaded; the message names it and why."""


class CheckpointUnavailable(Exception):
    """A checkpoint that could not be loaded now (memory, device, storage I/O): retry later, never set it aside."""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


# I/O errors of a working file on failing storage or a full disk: the file may be fine, the moment is not.
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ENOSPC, errno.ETIMEDOUT, errno.EAGAIN, errno.ENOMEM,
                               errno.ESTALE, errno.ENETDOWN, errno.ENETUNREACH, errno.ECONNRESET,
                               errno.EHOSTUNREACH, errno.EDQUOT,
                               # not the file's content: a mount or permission problem restarting may outlive
                               errno.EACCES, errno.EPERM, errno.EROFS})


def transient(exc: BaseException) -> bool:
    """True when `exc` says "could not load now" (memory, device, storage), not "this file is bad"."""
    if isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError | TimeoutError):
        return True
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | IsADirectoryError | NotADirectoryError):
        return exc.errno in _TRANSIENT_ERRNOS or exc.errno is None
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return any(s in text for s in ("out of memory", "CUDA error", "CUDA driver", "cuDNN error", "NCCL error",
                                       "Input/output error", "No space left", "HIP error", "XPU error"))
    return False


def classify(path: str, exc: BaseException) -> Exception:
    """The exception to raise for `exc` met while loading `path`: unavailable now, refused, or corrupt."""
    if transient(exc):
        return CheckpointUnavailable(f"{path}: could not be loaded now ({type(exc).__name__}: {_first_line(exc)}); "
                                     "the checkpoint is kept and the gang restarts to try again")
    if isinstance(exc, pickle.UnpicklingError):
        # torch's own text advises weights_only=False: never the fix for a file we did not write; name the global
        named = re.search(r"Unsupported global: GLOBAL ([\w.]+)|global '([\w.]+)'", str(exc))
        what = f"it names {named.group(1) or named.group(2)}" if named else _first_line(exc)
        return UnusableCheckpoint(f"{path}: refused: it holds objects other than tensors and plain values "
                                  f"(tampered, or not written by seqtrain): {what}")
    return UnusableCheckpoint(f"{path}: unreadable (truncated or corrupt): {type(exc).__name__}: "
                              f"{_first_line(exc)}")


_LOAD_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError,
                MemoryError, KeyError, TypeError, AttributeError, IndexError, TimeoutError)


def load_plain(path: str, map_location: Any = "cpu") -> Any:
    """torch.load with weights_only=True onto the CPU; raises UnusableCheckpoint / CheckpointUnavailable naming
    the file."""
    refuse_symlink(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except _LOAD_ERRORS as exc:
        raise classify(path, exc) from None


def refuse_symlink(path: str) -> None:
    if os.path.islink(path):
        raise UnusableCheckpoint(f"{path}: refused: a symbolic link (checkpoint files are never followed through "
                                 "links; copy the file in its place)")


def _library_globals() -> list[Any]:
    """The plain classes DeepSpeed pickles into its ZeRO files (data holders and enums: building them runs
    nothing of the file's choosing)."""
    out: list[Any] = []
    if "deepspeed" not in sys.modules:  # only DeepSpeed's files need them (and importing it is slow)
        return out
    with contextlib.suppress(ImportError):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    return out


@contextlib.contextmanager
def restricted_loads(what: str) -> Iterator[list[Exception]]:
    """Every `torch.load` made inside (by DeepSpeed or DCP on files they name) is weights_only with the library
    allowlist and maps to the CPU unless told otherwise; a refusal or a corrupt file raises UnusableCheckpoint
    naming the file, a fault of the moment CheckpointUnavailable. `what` names the folder for messages. Yields the
    list of those raised (a library may wrap them in its own exception: `dcp_load` unwraps them)."""
    original = torch.load
    allowed = _library_globals()
    raised: list[Exception] = []

    def guarded(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("weights_only", None)
        kwargs.pop("pickle_module", None)
        name = f if isinstance(f, str | os.PathLike) else f"a record inside {what}"
        if isinstance(f, str | os.PathLike):
            refuse_symlink(str(f))
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, map_location=map_location if map_location is not None else "cpu",
                                weights_only=True, **kwargs)
        except _LOAD_ERRORS as exc:
            raised.append(classify(str(name), exc))
            raise raised[-1] from None

    torch.load = guarded  # type: ignore[assignment]
    try:
        yield raised
    finally:
        torch.load = original  # type: ignore[assignment]


# ---- DCP's .metadata ----------------------------------------------------------------------------------------
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_PLAIN = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
          ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
          ("pathlib", "PurePosixPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
          ("torch.distributed.checkpoint.planner", "LoadItemType"),
          ("torch.distributed.checkpoint.planner", "WriteItemType")}


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do here: Python >= 3.12 pickles an Enum member as getattr(EnumClass, "NAME")
    (the trainer image's and the GPU machines' Python; 3.11 pickles it by value). Only a member of an Enum class the
    Unpickler itself let through, by its member name: no other attribute of anything."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) is not "
                                 "allowed in DCP metadata (only members of its Enum classes)")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _PLAIN or (module in _DCP_MODULES and not name.startswith("__")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout |
                                            torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed in DCP metadata")


def read_dcp_metadata(path: str) -> Any:
    """DCP's `.metadata` file through the restricted Unpickler; errors name the file."""
    refuse_symlink(path)
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except _LOAD_ERRORS as exc:
        raise classify(path, exc) from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(meta, Metadata):
        raise UnusableCheckpoint(f"{path}: not DCP metadata (it holds a {type(meta).__name__})")
    return meta


def safe_fs_reader(folder: str) -> Any:
    """A DCP FileSystemReader whose `.metadata` goes through `read_dcp_metadata` (data items: `restricted_loads`).
    The metadata is read (and refused) here, before DCP runs: DCP would wrap the refusal in its own exception."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(os.path.join(folder, ".metadata"))

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(folder)


def dcp_load(folder: str, load: Callable[[Any], Any]) -> Any:
    """Run `load(storage_reader)` (dcp.load or its in-memory equivalent) on the DCP folder with seqtrain's readers;
    a refused, corrupt or unavailable file raises UnusableCheckpoint / CheckpointUnavailable naming it, not DCP's
    CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = safe_fs_reader(folder)
    data = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))  # where DCP's byte records live
    with restricted_loads(", ".join(os.path.join(folder, n) for n in data) or folder) as raised:
        try:
            return load(reader)
        except CheckpointException as exc:
            if raised:
                raise raised[0] from None
            failures = list(getattr(exc, "failures", {}).values())
            first = failures[0] if failures else exc
            cause = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) \
                else first if isinstance(first, BaseException) else exc
            raise classify(folder, cause) from None


def require_layout(directory: str, engine: str, **layout: int) -> None:
    """Before a library loads its own files (DeepSpeed's shards, DCP's folder): the checkpoint's meta.json must
    name this engine and these layout degrees (dp/tp/pp given as keywords). A mismatch is the job's change, not
    damage: InvalidConfig (the job fails at once, the checkpoint is kept)."""
    import json

    path = os.path.join(directory, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise UnusableCheckpoint(f"{path}: unreadable: {_first_line(exc)}") from None
    if meta.get("engine") != engine:
        raise InvalidConfig(f"{path}: written by engine {meta.get('engine')!r}, but this job runs {engine!r}: "
                            "resume with the engine in its meta.json, or use a new checkpoint folder")
    saved = meta.get("layout") or {}
    for key, want in layout.items():
        if saved.get(key) != want:
            raise InvalidConfig(f"{path}: layout {key}={saved.get(key)} but this job runs {key}={want}: resume "
                                "with the layout in its meta.json, or use a new checkpoint folder")
