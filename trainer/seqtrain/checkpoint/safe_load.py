"""THE loader for every pickle seqtrain reads (checkpoints, model folders): tensors and plain values only.

Files in a checkpoint folder may come from anyone who can write the storage (a shared PVC, a downloaded run), so
no file may run code when it is loaded. Every unpickling in seqtrain goes through this module:
- `load_plain`: seqtrain's own files (`trainer.pt`, `rng-rank*.pt`), with `torch.load(weights_only=True)` onto
  the CPU;
- `restricted_loads()`: while DCP loads its byte items, every `torch.load` it makes is held to weights_only=True
  (tensors and plain values only), whatever `weights_only` it asked for;
- `SafeFileSystemReader`: DCP's `.metadata` (a raw pickle) through an Unpickler that builds only the classes of
  an exact (module, name) table (DCP's metadata dataclasses, torch sizes/dtypes/layouts, plain containers), and
  whose result must be DCP metadata describing only byte ranges of this folder's `.distcp` files
  (`check_dcp_metadata`).
A file that names anything else (a planted payload) is refused before anything of it runs: `UnusableCheckpoint`
naming the file. Errors are told apart: `UnusableCheckpoint` is the file's fault (refused, truncated, corrupt: the
trainer sets the checkpoint aside and falls back to the previous one); `CheckpointUnavailable` is this moment's
(out of memory, a CUDA error, an I/O error such as EIO, ENOSPC or a timeout of the storage): the checkpoint is
kept and the rank exits CHECKPOINT_UNAVAILABLE, which the controller retries as an infrastructure failure.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import torch


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


@contextlib.contextmanager
def restricted_loads(what: str) -> Iterator[list[Exception]]:
    """Every `torch.load` made inside (by DCP on the files it names) is weights_only and maps to the CPU unless
    told otherwise; a refusal or a corrupt file raises UnusableCheckpoint naming the file, a fault of the moment
    CheckpointUnavailable. `what` names the folder for messages. Yields the list of those raised (DCP wraps them
    in its own exception: `dcp_load` unwraps them)."""
    original = torch.load
    raised: list[Exception] = []

    def guarded(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("weights_only", None)
        kwargs.pop("pickle_module", None)
        name = f if isinstance(f, str | os.PathLike) else f"a record inside {what}"
        if isinstance(f, str | os.PathLike):
            refuse_symlink(str(f))
        try:
            return original(f, map_location=map_location if map_location is not None else "cpu", weights_only=True,
                            **kwargs)
        except _LOAD_ERRORS as exc:
            raised.append(classify(str(name), exc))
            raise raised[-1] from None

    torch.load = guarded  # type: ignore[assignment]
    try:
        yield raised
    finally:
        torch.load = original  # type: ignore[assignment]


# ---- DCP's .metadata ----------------------------------------------------------------------------------------
# DCP writes `.metadata` with a plain `pickle.dump` (protocol 4 and up): dataclasses of
# torch.distributed.checkpoint.metadata, the filesystem writer's _StorageInfo, torch sizes/dtypes/layouts and, as
# StorageMeta.checkpoint_id, a path. These are every global that torch 2.11-2.13's DCP writes (recorded from real
# saves of every engine, see tests/unit/test_untrusted_metadata.py): an exact (module, name) table, resolved here
# from objects imported by seqtrain, never by importing or walking what the file names. A dotted name
# ("torch.distributed.checkpoint.metadata" + "os.system") is just another name that is not in the table.
METADATA_MAX_BYTES = 1 << 30  # far above any real `.metadata` (about 150 bytes per tensor chunk)
_MAX_DIMS = 64  # a tensor's dimensions (DCP sizes and offsets): torch itself stops at 64
_MAX_PATH = 64  # elements of a planner_data path (the nesting depth of the saved state dict)


def _metadata_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    objects = [metadata.Metadata, metadata.TensorStorageMetadata, metadata.BytesStorageMetadata,
               metadata.ChunkStorageMetadata, metadata.TensorProperties, metadata.MetadataIndex, metadata.StorageMeta,
               metadata._MEM_FORMAT_ENCODING, filesystem._StorageInfo, torch.Size,
               torch.serialization._get_layout,  # a layout's name -> torch.layout
               pathlib.PosixPath, pathlib.PurePosixPath,  # StorageMeta.checkpoint_id as the writer was given it
               collections.OrderedDict]
    # keyed as pickle writes them: the object's own module and name (pathlib's classes live in pathlib._local from
    # Python 3.13 on), and for the paths also as older Pythons wrote them
    table: dict[tuple[str, str], Any] = {(obj.__module__, obj.__qualname__): obj for obj in objects}
    table[("pathlib", "PosixPath")] = pathlib.PosixPath
    table[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    # Python >= 3.12 pickles an Enum member as getattr(EnumClass, "NAME"): only that, by `_enum_member`
    table[("builtins", "getattr")] = _enum_member
    for name in dir(torch):  # torch.float32 pickles as the global `torch float32`; torch.strided, torch.channels_last
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format) and name.isidentifier():
            table[("torch", name)] = value
    return table


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in DCP metadata: the member `name` of _MEM_FORMAT_ENCODING (Python >= 3.12
    pickles an Enum member as getattr(EnumClass, "NAME"); 3.11 by value). No other attribute of anything."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    if cls is _MEM_FORMAT_ENCODING and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {str(name)[:60]!r}) "
                                 "is not allowed in DCP metadata (only members of its Enum classes)")


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]  # the Python one: each opcode is ours
    """Builds only the objects of `_metadata_globals()`. The pure-Python Unpickler, so that every opcode that
    could call, build or mutate something is checked here, not only the name lookups: REDUCE / NEWOBJ call only a
    class or function of the table; BUILD fills only an instance (never a class: that would patch it for the whole
    process) of a table class, and only with its own field names; APPEND(S) / SETITEM(S) / ADDITEMS act only on
    plain lists / dicts / sets; INST, OBJ, the extension registry, persistent ids and protocol-5 bytearrays and
    buffers (never in DCP's files) are refused. Reads come from the file's bytes in memory, so a declared length beyond them allocates nothing."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._globals = _globals()
        self._callables = set(map(id, self._globals.values()))
        self._classes = tuple(v for v in self._globals.values() if isinstance(v, type))

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name)) if isinstance(module, str) and isinstance(name, str) else None
        if found is None:
            raise pickle.UnpicklingError(f"global '{str(module)[:80]}.{str(name)[:80]}' is not allowed in DCP "
                                         "metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id is not allowed in DCP metadata")

    def _refuse(self, what: str) -> None:
        raise pickle.UnpicklingError(f"{what} is not allowed in DCP metadata")

    def _callable(self, func: Any, opcode: str) -> None:
        if id(func) not in self._callables:
            self._refuse(f"{opcode} of a {type(func).__name__}")

    def load_reduce(self) -> None:
        self._callable(self.stack[-2], "REDUCE")
        pickle._Unpickler.load_reduce(self)  # type: ignore[attr-defined]

    def load_newobj(self) -> None:
        self._callable(self.stack[-2], "NEWOBJ")
        if not isinstance(self.stack[-2], type):
            self._refuse("NEWOBJ of a function")
        pickle._Unpickler.load_newobj(self)  # type: ignore[attr-defined]

    def load_newobj_ex(self) -> None:
        self._callable(self.stack[-3], "NEWOBJ_EX")
        if not isinstance(self.stack[-3], type):
            self._refuse("NEWOBJ_EX of a function")
        pickle._Unpickler.load_newobj_ex(self)  # type: ignore[attr-defined]

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type) or not isinstance(inst, self._classes) or type(inst) not in self._classes:
            self._refuse(f"BUILD of a {type(inst).__name__}")
        import dataclasses

        if dataclasses.is_dataclass(inst) and type(inst) is not _tensor_properties():
            names = {f.name for f in dataclasses.fields(inst)}
            slots = None
            if isinstance(state, tuple) and len(state) == 2:
                state, slots = state
            for part in (state, slots):
                if part is None:
                    continue
                if type(part) is not dict or not all(type(k) is str and k in names for k in part):
                    self._refuse(f"BUILD of {type(inst).__name__} with other than its fields")
        elif type(inst) is _tensor_properties():
            if type(state) is not tuple:  # its __setstate__ unpacks a 5-tuple
                self._refuse("BUILD of TensorProperties with other than a tuple")
        else:
            self._refuse(f"BUILD of a {type(inst).__name__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    def _on(self, kind: type | tuple[type, ...], opcode: str, at: Any) -> None:
        if type(at) not in (kind if isinstance(kind, tuple) else (kind,)):
            self._refuse(f"{opcode} on a {type(at).__name__}")

    def load_append(self) -> None:
        self._on(list, "APPEND", self.stack[-2])
        pickle._Unpickler.load_append(self)  # type: ignore[attr-defined]

    def load_appends(self) -> None:
        self._on(list, "APPENDS", self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None)
        pickle._Unpickler.load_appends(self)  # type: ignore[attr-defined]

    def load_setitem(self) -> None:
        self._on((dict, collections.OrderedDict), "SETITEM", self.stack[-3])
        pickle._Unpickler.load_setitem(self)  # type: ignore[attr-defined]

    def load_setitems(self) -> None:
        self._on((dict, collections.OrderedDict), "SETITEMS",
                 self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None)
        pickle._Unpickler.load_setitems(self)  # type: ignore[attr-defined]

    def load_additems(self) -> None:
        self._on(set, "ADDITEMS", self.metastack[-1][-1] if self.metastack and self.metastack[-1] else None)
        pickle._Unpickler.load_additems(self)  # type: ignore[attr-defined]

    def load_refused(self) -> None:
        self._refuse("this pickle opcode (INST, OBJ, EXT, PERSID or a protocol-5 buffer)")


for _name, _method in [("REDUCE", "load_reduce"), ("NEWOBJ", "load_newobj"), ("NEWOBJ_EX", "load_newobj_ex"),
                       ("BUILD", "load_build"), ("APPEND", "load_append"), ("APPENDS", "load_appends"),
                       ("SETITEM", "load_setitem"), ("SETITEMS", "load_setitems"), ("ADDITEMS", "load_additems"),
                       ("INST", "load_refused"), ("OBJ", "load_refused"), ("EXT1", "load_refused"),
                       ("EXT2", "load_refused"), ("EXT4", "load_refused"), ("PERSID", "load_refused"),
                       ("BINPERSID", "load_refused"),
                       # BYTEARRAY8 allocates its declared length before reading it; out-of-band buffers need a
                       # `buffers` argument: DCP writes neither
                       ("BYTEARRAY8", "load_refused"), ("NEXT_BUFFER", "load_refused"),
                       ("READONLY_BUFFER", "load_refused")]:
    _MetadataUnpickler.dispatch[getattr(pickle, _name)[0]] = getattr(_MetadataUnpickler, _method)
del _name, _method

_GLOBALS: dict[tuple[str, str], Any] = {}


def _globals() -> dict[tuple[str, str], Any]:
    if not _GLOBALS:
        _GLOBALS.update(_metadata_globals())
    return _GLOBALS


def _tensor_properties() -> type:
    from torch.distributed.checkpoint.metadata import TensorProperties

    return TensorProperties


class _Invalid(Exception):
    """A `.metadata` that unpickled into something other than the DCP metadata of a checkpoint of this folder."""


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise _Invalid(what)


def _int(x: Any, lo: int, hi: int | None = None) -> bool:
    return type(x) is int and x >= lo and (hi is None or x <= hi)


def _size(x: Any, what: str) -> tuple[int, ...]:
    _check(type(x) is torch.Size and len(x) <= _MAX_DIMS and all(d >= 0 for d in x), f"{what} is not a size")
    return tuple(x)


def check_dcp_metadata(meta: Any, folder: str) -> None:
    """`meta` is DCP metadata whose every member has the type DCP gives it, whose tensors' chunks lie inside their
    tensors and cover them once by count, whose every item is stored inside a `.distcp` file of `folder` (a plain
    name, no transforms) in a byte range of that file, long enough for the item's tensor data: so loading it reads
    only this folder's files and allocates no more than they hold. Raises _Invalid saying what is wrong."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    _check(type(meta) is Metadata, f"it holds a {type(meta).__name__}, not DCP's Metadata")
    sdm = meta.state_dict_metadata
    _check(type(sdm) is dict, "state_dict_metadata is not a dict")
    storage = meta.storage_data
    _check(type(storage) is dict, "storage_data is not a dict")
    _check(meta.version is None or type(meta.version) is str, "version is not a string")
    sm = meta.storage_meta
    _check(sm is None or (type(sm) is StorageMeta and type(sm.modules) is list
                          and all(type(m) is str for m in sm.modules)
                          and all(v is None or type(v) is str for v in (sm.save_id, sm.load_id))
                          and (sm.checkpoint_id is None or isinstance(sm.checkpoint_id, str | os.PathLike))),
           "storage_meta is not DCP's StorageMeta")
    sizes: dict[str, int] = {}
    for key, info in storage.items():
        _check(type(key) is MetadataIndex and type(key.fqn) is str
               and (key.offset is None or type(key.offset) is torch.Size)
               and (key.index is None or type(key.index) is int), "a storage_data key is not a MetadataIndex")
        _check(type(info) is _StorageInfo, f"storage_data[{key.fqn[:80]!r}] is not a _StorageInfo")
        name = info.relative_path
        _check(type(name) is str and name.endswith(".distcp") and os.path.basename(name) == name
               and name not in (".", ".."), f"storage_data[{key.fqn[:80]!r}] names file {str(name)[:80]!r}, not a "
               ".distcp file of the checkpoint's own folder")
        _check(not info.transform_descriptors, f"storage_data[{key.fqn[:80]!r}] asks for transforms "
               "(seqtrain writes none)")
        if name not in sizes:
            path = os.path.join(folder, name)
            refuse_symlink(path)
            try:
                sizes[name] = os.path.getsize(path)
            except FileNotFoundError:
                raise _Invalid(f"storage_data[{key.fqn[:80]!r}] names {name}, which is missing") from None
        _check(_int(info.offset, 0) and _int(info.length, 0) and info.offset + info.length <= sizes[name],
               f"storage_data[{key.fqn[:80]!r}]: bytes {info.offset}+{info.length} lie outside {name} "
               f"({sizes[name]} bytes)")
    for fqn, item in sdm.items():
        _check(type(fqn) is str, "a state_dict_metadata key is not a string")
        if type(item) is BytesStorageMetadata:
            _check(MetadataIndex(fqn) in storage, f"{fqn[:80]!r} has no storage_data entry")
            continue
        _check(type(item) is TensorStorageMetadata, f"{fqn[:80]!r} is a {type(item).__name__}, not a tensor's or "
               "bytes' metadata")
        p = item.properties
        _check(type(p) is TensorProperties and type(p.dtype) is torch.dtype and type(p.layout) is torch.layout
               and type(p.memory_format) is torch.memory_format and type(p.requires_grad) is bool
               and type(p.pin_memory) is bool, f"{fqn[:80]!r}: properties are not DCP's TensorProperties")
        shape = _size(item.size, f"{fqn[:80]!r}: size")
        _check(type(item.chunks) is list, f"{fqn[:80]!r}: chunks is not a list")
        total, covered = 1, 0
        for d in shape:
            total *= d
        for chunk in item.chunks:
            _check(type(chunk) is ChunkStorageMetadata, f"{fqn[:80]!r}: a chunk is not DCP's ChunkStorageMetadata")
            off = _size(chunk.offsets, f"{fqn[:80]!r}: a chunk's offsets")
            ext = _size(chunk.sizes, f"{fqn[:80]!r}: a chunk's sizes")
            _check(len(off) == len(ext) == len(shape)
                   and all(o + e <= d for o, e, d in zip(off, ext, shape, strict=True)),
                   f"{fqn[:80]!r}: a chunk lies outside the tensor's size {list(shape)}")
            n = 1
            for e in ext:
                n *= e
            covered += n
            info = storage.get(MetadataIndex(fqn, off))
            _check(info is not None, f"{fqn[:80]!r}: a chunk has no storage_data entry")
            # DCP stores each chunk as torch.save of the tensor: at least its elements' bytes
            _check(info.length >= n * p.dtype.itemsize, f"{fqn[:80]!r}: a chunk of {n} elements is stored in "
                   f"{info.length} bytes")
        _check(covered == total, f"{fqn[:80]!r}: its chunks hold {covered} elements, its size {total}")
    pd = meta.planner_data
    if pd is not None:
        _check(type(pd) is dict, "planner_data is not a dict")
        limit = len(sdm)
        for fqn, path in pd.items():
            # DCP rebuilds the nesting of a state dict along these paths; a list index grows a list up to it
            _check(type(fqn) is str and type(path) is tuple and 0 < len(path) <= _MAX_PATH
                   and all(type(x) is str or _int(x, 0, limit) for x in path),
                   f"planner_data[{str(fqn)[:80]!r}] is not a path of names and list indices")


def read_dcp_metadata(path: str) -> Any:
    """DCP's `.metadata` file through the restricted Unpickler, checked by `check_dcp_metadata` against its own
    folder; errors (UnusableCheckpoint / CheckpointUnavailable) name the file."""
    refuse_symlink(path)
    try:
        with open(path, "rb") as f:
            data = f.read(METADATA_MAX_BYTES + 1)
    except OSError as exc:
        raise classify(path, exc) from None
    if len(data) > METADATA_MAX_BYTES:
        raise UnusableCheckpoint(f"{path}: refused: larger than {METADATA_MAX_BYTES >> 20} MiB (not DCP metadata)")
    try:
        meta = _MetadataUnpickler(data).load()
    except (*_LOAD_ERRORS, RecursionError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise classify(path, exc) from None
    try:
        check_dcp_metadata(meta, os.path.dirname(path))
    except _Invalid as exc:
        raise UnusableCheckpoint(f"{path}: refused: not the DCP metadata of this folder: {exc}") from None
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

