"""No code runs from a checkpoint file, by construction: every way a pickle can name or call something, planted in
every pickled file a checkpoint of each engine holds, under `seqtrain export`, `seqtrain generate`, `model.init` and
resume. Each payload would create a marker file; the marker never appears and each attempt is refused with one line
naming the file.

DCP's `.metadata` is a raw pickle (the other files load with torch's weights_only Unpickler): it is read through an
exact (module, name) table (`seqtrain.checkpoint.safe_load`), so a dotted name that resolves attribute by attribute
under pickle protocol 4 (`torch.distributed.checkpoint.metadata` + `os.system`) is just a name outside the table.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_trainer  # the same in-process world-1 trainer

from seqtrain.checkpoint.discovery import quarantined
from seqtrain.checkpoint.safe_load import UnusableCheckpoint, load_plain, read_dcp_metadata, restricted_loads
from seqtrain.runtime.exitcodes import InvalidConfig
from seqtrain_operator.cli import main as cli_main

MOD = "torch.distributed.checkpoint.metadata"  # the module the old find_class let through


# ---- pickles, byte by byte ----------------------------------------------------------------------------------
def _s(text: str) -> bytes:
    data = text.encode()
    if len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + len(data).to_bytes(4, "little") + data


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + pickle.STACK_GLOBAL


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _call(func: bytes, *args: bytes) -> bytes:
    return func + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def _p4(body: bytes, proto: int = 4) -> bytes:
    return pickle.PROTO + bytes([proto]) + body + pickle.STOP


def _evil_pickle(marker: Path) -> bytes:
    """A plain pickle that runs `touch marker` when any full Unpickler loads it."""
    return _p4(_call(_global("os", "system"), _s(f"touch {marker}")), 2)


def _variants(marker: Path, evil: Path) -> dict[str, bytes]:
    """Every way we know for a pickle to run `touch marker` (`evil`: a plain pickle file that does, for the
    payloads that make a full loader read another file)."""
    cmd = _s(f"touch {marker}")
    raw = _evil_pickle(marker)
    return {
        "GLOBAL-dotted-os.system": _p4(_call(_global(MOD, "os.system"), cmd)),
        "STACK_GLOBAL-dotted-os.system": _p4(_call(_stack_global(MOD, "os.system"), cmd)),
        "STACK_GLOBAL-dotted-protocol-5": _p4(_call(_stack_global(MOD, "os.system"), cmd), 5),
        "STACK_GLOBAL-torch.serialization.os.system": _p4(_call(_stack_global(MOD, "torch.serialization.os.system"),
                                                                cmd)),
        "STACK_GLOBAL-os.popen": _p4(_call(_stack_global(MOD, "os.popen"), cmd)),
        "INST-dotted-os.system": _p4(pickle.MARK + cmd + pickle.INST + f"{MOD}\nos.system\n".encode()),
        "OBJ-dotted-os.system": _p4(pickle.MARK + _stack_global(MOD, "os.system") + cmd + pickle.OBJ),
        "REDUCE-builtins.eval": _p4(_call(_stack_global(MOD, "torch.builtins.eval"),
                                          _s(f"__import__('os').system('touch {marker}')"))),
        "REDUCE-__builtins__.eval": _p4(_call(_stack_global(MOD, "__builtins__.eval"),
                                              _s(f"__import__('os').system('touch {marker}')"))),
        "REDUCE-torch.load-with-pickle-module": _p4(_call(_stack_global(MOD, "torch.load"), _s(str(evil)),
                                                          pickle.NONE, _stack_global(MOD,
                                                                                     "torch.serialization.pickle"))),
        "REDUCE-torch.storage._load_from_bytes": _p4(_call(_stack_global(MOD, "torch.storage._load_from_bytes"),
                                                           pickle.BINBYTES + len(raw).to_bytes(4, "little") + raw)),
        "REDUCE-pickle.loads": _p4(_call(_stack_global(MOD, "torch.serialization.pickle.loads"),
                                         pickle.BINBYTES + len(raw).to_bytes(4, "little") + raw)),
        "REDUCE-functools.partial-then-call": _p4(
            _call(_stack_global(MOD, "torch.functools.partial"), _stack_global(MOD, "os.system"), cmd)
            + pickle.EMPTY_TUPLE + pickle.REDUCE),
        "REDUCE-importlib-then-getattr-chain": _p4(_call(
            _stack_global("builtins", "getattr"),
            _call(_stack_global(MOD, "torch.importlib.import_module"), _s("subprocess")), _s("Popen"))
            + pickle.MARK + pickle.MARK + _s("touch") + _s(str(marker)) + pickle.LIST + pickle.TUPLE
            + pickle.REDUCE),
        "REDUCE-builtins.getattr-of-a-module": _p4(
            _call(_stack_global("builtins", "getattr"), _stack_global(MOD, "os"), _s("system"))
            + pickle.MARK + cmd + pickle.TUPLE + pickle.REDUCE),
        "REDUCE-plain-os.system": _p4(_call(_stack_global("os", "system"), cmd)),
        "REDUCE-posix.system": _p4(_call(_stack_global("posix", "system"), cmd)),
        "REDUCE-subprocess.Popen": _p4(_call(_stack_global("subprocess", "Popen"),
                                             pickle.MARK + _s("touch") + _s(str(marker)) + pickle.LIST)),
        "REDUCE-plain-torch.load": _p4(_call(_stack_global("torch", "load"), _s(str(evil)))),
        "REDUCE-torch-dotted-float32.__class__": _p4(_call(_stack_global("torch", "float32.__class__"), cmd)),
        "payload-inside-a-valid-Metadata": _p4(_call(_stack_global(MOD, "Metadata"), pickle.EMPTY_DICT,
                                                     _call(_stack_global(MOD, "os.system"), cmd))),
        "EXT1-registry": _p4(pickle.EXT1 + b"\x01"),
        "PERSID": _p4(_s("x") + pickle.BINPERSID),
    }


def _payloads(marker: Path, tmp: Path) -> dict[str, bytes]:
    evil = tmp / "evil.pt"
    evil.write_bytes(_evil_pickle(marker))
    return _variants(marker, evil)


VARIANT_NAMES = list(_variants(Path("/m"), Path("/e")))
CORE = ["STACK_GLOBAL-dotted-os.system", "INST-dotted-os.system", "REDUCE-torch.storage._load_from_bytes"]


@pytest.fixture()
def marker() -> Path:
    path = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")
    yield path
    if path.exists():
        path.unlink()


def _never_ran(marker: Path) -> None:
    import time

    time.sleep(0.05)  # os.popen and Popen return before their child runs: give a payload that ran the time to show
    assert not marker.exists(), "the planted payload ran"


def _one_line(text: str, name: str) -> None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert lines and name in lines[-1] and "Traceback" not in text, text


# ---- the reader itself -------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_every_pickle_variant_is_refused_naming_the_file(variant: str, tmp_path: Path, marker: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(_payloads(marker, tmp_path)[variant])
    with pytest.raises(UnusableCheckpoint) as err:
        read_dcp_metadata(str(path))
    _one_line(str(err.value), str(path))
    _never_ran(marker)


def test_build_on_a_class_never_patches_it(tmp_path: Path) -> None:
    """BUILD on a class object (not an instance) would setattr on it for the whole process."""
    from torch.distributed.checkpoint.metadata import Metadata

    before = Metadata.__dict__.get("__eq__")
    body = (_stack_global(MOD, "Metadata") + pickle.NONE + pickle.EMPTY_DICT + _s("__eq__")
            + _stack_global("torch", "Size") + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD)
    path = tmp_path / ".metadata"
    path.write_bytes(_p4(body))
    try:
        with pytest.raises(UnusableCheckpoint, match=r"\.metadata: refused"):
            read_dcp_metadata(str(path))
        assert Metadata.__dict__.get("__eq__") is before
    finally:
        if Metadata.__dict__.get("__eq__") is not before:
            Metadata.__eq__ = before  # the old reader let it through: undo it for the rest of the session


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path_factory.mktemp("dcp") / "state"
    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)},
             "optim": {"state": {"w": {"step": torch.tensor(1.0)}}}, "scheduler": {"last_epoch": 3},
             "lst": [torch.ones(2), 5]}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _rewrite(folder: Path, tmp_path: Path, change: Callable) -> Path:  # noqa: ANN001
    """A copy of the DCP folder whose metadata, loaded in full and changed by `change`, is pickled again."""
    out = tmp_path / "state"
    shutil.copytree(folder, out)
    with open(out / ".metadata", "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - our own file, written by the fixture
    change(meta)
    with open(out / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return out


def test_the_real_metadata_loads(dcp_folder: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    meta = read_dcp_metadata(str(dcp_folder / ".metadata"))
    assert type(meta) is Metadata and set(meta.state_dict_metadata) >= {"model.w", "model.b", "lst.0"}


def test_the_table_holds_exact_names_and_reads_python_3_12s_enum_pickles(dcp_folder: Path, tmp_path: Path) -> None:
    """Every name is one identifier (no dotted lookups), and Python >= 3.12's way of pickling an Enum member,
    getattr(EnumClass, "NAME"), still reads (the GPU machines' Python; 3.11 pickles it by value)."""
    import enum
    import io

    from seqtrain.checkpoint.safe_load import _globals

    assert all(name.isidentifier() and "." not in name for _, name in _globals())

    class Py312(pickle.Pickler):
        def reducer_override(self, obj):  # noqa: ANN001, ANN202
            if isinstance(obj, enum.Enum):
                return getattr, (type(obj), obj.name)
            return NotImplemented

    out = tmp_path / "state"
    shutil.copytree(dcp_folder, out)
    with open(out / ".metadata", "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - our own file, written by the fixture
    buf = io.BytesIO()
    Py312(buf, protocol=4).dump(meta)
    assert b"getattr" in buf.getvalue()
    (out / ".metadata").write_bytes(buf.getvalue())
    assert read_dcp_metadata(str(out / ".metadata")).state_dict_metadata.keys() == meta.state_dict_metadata.keys()


def _first_storage(meta):  # noqa: ANN001, ANN202
    return next(iter(meta.storage_data.values()))


def _chunk_of(meta, fqn: str):  # noqa: ANN001, ANN202
    return meta.state_dict_metadata[fqn].chunks[0]


STRUCTURAL = {
    # a data file outside the folder: its bytes would become weights (what `export` then publishes)
    "relative-path-escapes": (lambda m: setattr(_first_storage(m), "relative_path", "../../../etc/hostname"),
                              "not a .distcp file"),
    "absolute-path": (lambda m: setattr(_first_storage(m), "relative_path", "/etc/hostname"), "not a .distcp file"),
    "byte-range-beyond-the-file": (lambda m: setattr(_first_storage(m), "length", 1 << 40), "lie outside"),
    "transforms": (lambda m: setattr(_first_storage(m), "transform_descriptors", ["zstd"]), "transforms"),
    # a chunk that claims 10^12 elements: loading would allocate them
    "huge-declared-tensor": (lambda m: (setattr(m.state_dict_metadata["model.w"], "size", torch.Size([10**6] * 2)),
                                        setattr(_chunk_of(m, "model.w"), "sizes", torch.Size([10**6] * 2))),
                             "a chunk of 1000000000000 elements is stored in"),
    "chunk-outside-its-tensor": (lambda m: setattr(_chunk_of(m, "model.w"), "sizes", torch.Size([3, 5])),
                                 "outside the tensor"),
    # DCP grows a list up to a planner_data index: 10^12 would never end
    "huge-list-index": (lambda m: m.planner_data.__setitem__("lst.0", ("lst", 10**12)), "planner_data"),
    "not-a-Metadata": (lambda m: None, None),
    "wrong-member-type": (lambda m: m.state_dict_metadata.__setitem__("model.w", "not metadata"), "model.w"),
}


@pytest.mark.parametrize("case", list(STRUCTURAL))
def test_metadata_that_reads_outside_its_folder_or_allocates_unbounded_memory_is_refused(
        case: str, dcp_folder: Path, tmp_path: Path) -> None:
    change, match = STRUCTURAL[case]
    if case == "not-a-Metadata":
        out = tmp_path / "state"
        shutil.copytree(dcp_folder, out)
        with open(out / ".metadata", "wb") as f:
            pickle.dump({"state_dict_metadata": {}}, f)
        match = "not DCP's Metadata"
    else:
        out = _rewrite(dcp_folder, tmp_path, change)
    with pytest.raises(UnusableCheckpoint, match=match) as err:
        read_dcp_metadata(str(out / ".metadata"))
    _one_line(str(err.value), ".metadata")


# ---- every other pickled file of each engine ----------------------------------------------------------------
class Payload:
    """Unpickling this runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_torch_loaded_files_refuse_payloads_whatever_the_caller_asks(tmp_path: Path, marker: Path) -> None:
    """seqtrain's own files (trainer.pt, rng-rank*.pt) and DCP's byte items (through restricted_loads, whatever
    weights_only DCP asks for)."""
    import io

    for name in ("trainer.pt", "rng-rank0.pt"):
        path = tmp_path / name
        torch.save({"model": Payload(marker)}, path)
        with pytest.raises(UnusableCheckpoint) as err:
            load_plain(str(path))
        _one_line(str(err.value), name)
    item = io.BytesIO()
    torch.save({"last_epoch": Payload(marker)}, item)
    item.seek(0)
    with pytest.raises(UnusableCheckpoint) as err, restricted_loads(str(tmp_path / "state" / "__0_0.distcp")):
        torch.load(item, weights_only=False)
    _one_line(str(err.value), "__0_0.distcp")
    raw = tmp_path / "raw.pt"  # a bare pickle, not torch's zip container
    raw.write_bytes(_evil_pickle(marker))
    with pytest.raises(UnusableCheckpoint):
        load_plain(str(raw))
    _never_ran(marker)


# ---- the commands: export, generate, model.init, resume ---------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished in-process run with checkpoints 4 and 6 (copied by each test that changes it)."""
    wd = tmp_path_factory.mktemp("run")
    assert make_trainer(wd).run() == "completed"
    return wd


def _fix_meta(step: Path, name: str) -> None:
    """Record the planted file's size and hash in meta.json, as an attacker with write access would."""
    meta = json.loads((step / "meta.json").read_text())
    data = (step / name).read_bytes()
    meta.setdefault("sizes", {})[name] = len(data)
    meta.setdefault("sha256", {})[name] = hashlib.sha256(data).hexdigest()
    (step / "meta.json").write_text(json.dumps(meta))


def _planted(trained: Path, tmp_path: Path, name: str, data: bytes) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step = run / "ckpt" / "step-6"
    (step / name).write_bytes(data)
    _fix_meta(step, name)
    return step


def _model_init_refuses(step: Path, name: str) -> None:
    from seqtrain.export.init import load_initial_weights
    from seqtrain.export.weights import _read_json
    from seqtrain.models import build_model
    from seqtrain.spec import SeqTrainJob, resolve

    job = resolve(SeqTrainJob.model_validate(_read_json(str(step / "meta.json"))["job"]))
    with pytest.raises(InvalidConfig) as err:
        load_initial_weights(build_model(job.spec.model), str(step))
    assert str(err.value).startswith("spec.model.init: ")
    _one_line(str(err.value), name)


@pytest.mark.parametrize("variant", VARIANT_NAMES)
def test_export_generate_and_model_init_refuse_every_variant(variant: str, trained: Path, tmp_path: Path,
                                                             marker: Path, capsys) -> None:  # noqa: ANN001
    step = _planted(trained, tmp_path, "state/.metadata", _payloads(marker, tmp_path)[variant])
    assert cli_main(["export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, ".metadata")
    assert cli_main(["generate", str(step), "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"]) == 2
    _one_line(capsys.readouterr().err, ".metadata")
    _model_init_refuses(step, ".metadata")
    _never_ran(marker)


def test_a_payload_in_a_dcp_byte_item_is_refused(trained: Path, tmp_path: Path, marker: Path, capsys) -> None:
    """The .distcp byte items (plain values DCP pickles with torch.save): loaded weights_only."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step, folder = run / "ckpt" / "step-6", run / "ckpt" / "step-6" / "state"
    state: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(folder)),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        state["scheduler"]["last_epoch"] = Payload(marker)
        shutil.rmtree(folder)
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    for name in os.listdir(folder):
        _fix_meta(step, f"state/{name}")
    assert cli_main(["export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, ".distcp")
    _model_init_refuses(step, ".distcp")
    _never_ran(marker)


def _other_layout_step(tmp_path: Path, trained: Path, engine: str, files: dict[str, bytes]) -> Path:
    """A complete step folder without state/ (meta.json lists its files), as another version's engine laid out."""
    step = tmp_path / "other" / "step-6"
    step.mkdir(parents=True)
    meta = json.loads((trained / "ckpt" / "step-6" / "meta.json").read_text())
    for name, data in files.items():
        (step / name).parent.mkdir(parents=True, exist_ok=True)
        (step / name).write_bytes(data)
    (step / "meta.json").write_text(json.dumps({"step": 6, "engine": engine, "job": meta["job"],
                                                "files": sorted({n.split("/")[0] for n in files})}))
    return step


@pytest.mark.parametrize(("engine", "name", "found"), [
    ("fsdp2", "fsdp/.metadata", "fsdp/"), ("native", "engine.pt", "engine.pt"),
    ("native", "engine-pp0-tp0.pt", "engine-pp0-tp0.pt"),
    ("deepspeed", "zero/mp_rank_00_model_states.pt", "zero/"), ("native", "model.bin", "model.bin")])
def test_a_layout_without_state_is_refused_unread(engine: str, name: str, found: str, trained: Path, tmp_path: Path,
                                                  marker: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """Only `state/` is read: a folder holding anything else (here a planted pickle where such a layout kept its
    weights) is refused by export, consolidate and model.init in one line naming what it holds, before any file
    of it is opened."""
    from seqtrain.parallel.consolidate import main as consolidate_main

    payload = _payloads(marker, tmp_path)["STACK_GLOBAL-dotted-os.system"]
    step = _other_layout_step(tmp_path, trained, engine, {name: payload})

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a file of a refused layout was unpickled")

    monkeypatch.setattr(torch, "load", never)
    monkeypatch.setattr(pickle, "load", never)
    want = f"does not read ({found}); re-run it with this version or export it with the seqtrain that wrote it"
    assert cli_main(["export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    _one_line(capsys.readouterr().err, want)
    assert consolidate_main([str(step), str(tmp_path / "out.pt")]) == 2
    _one_line(capsys.readouterr().err, want)
    assert not (tmp_path / "out.pt").exists()
    _model_init_refuses(step, want)
    _never_ran(marker)


def _torch_saved(value: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# plain values in the wrong shape: they load weights_only, and used to end the resume in a traceback
MALFORMED = {"trainer.pt": {"step": "6", "data": []}, "rng-rank0.pt": {"python": 5, "numpy": None}}


@pytest.mark.parametrize(("name", "variant"), [("state/.metadata", v) for v in CORE]
                         + [("trainer.pt", CORE[0]), ("rng-rank0.pt", CORE[0]), ("trainer.pt", "malformed"),
                            ("rng-rank0.pt", "malformed")])
def test_resume_sets_a_planted_checkpoint_aside_and_runs_no_code(name: str, variant: str, trained: Path,
                                                                 tmp_path: Path, marker: Path) -> None:
    data = _torch_saved(MALFORMED[name]) if variant == "malformed" else _payloads(marker, tmp_path)[variant]
    step = _planted(trained, tmp_path, name, data)
    run = step.parent.parent
    t = make_trainer(run)  # the same 6 steps: resumes from step 4 once step 6 is set aside
    assert t.resumed_from is not None and t.resumed_from.step == 4
    (bad, reason), = quarantined(str(run / "ckpt"))
    assert bad == 6 and os.path.basename(name) in reason and "\n" not in reason.strip(), reason
    _never_ran(marker)


def test_a_checkpoint_nested_thousands_of_folders_deep_is_set_aside_not_a_recursion_error(tmp_path: Path) -> None:
    """os.walk (discovery) and shutil.rmtree (pruning) recurse on Python 3.11: a planted chain of 1500 folders ended
    the resume in RecursionError."""
    from seqtrain.checkpoint import CheckpointManager
    from seqtrain.checkpoint.discovery import problem, remove_tree
    from seqtrain.runtime.dist import DistContext

    def write(directory: str) -> list[str]:
        Path(directory, "x.pt").write_text("x")
        return ["x.pt"]

    mgr = CheckpointManager(str(tmp_path / "c"), keep=3, ctx=DistContext())
    mgr.save(4, write)
    mgr.save(6, write)
    deep = tmp_path / "c" / "step-6"
    cwd = os.getcwd()
    try:
        try:  # relative mkdirs: from inside, each path stays shorter than PATH_MAX
            os.chdir(deep)
            for _ in range(1500):
                os.mkdir("a")
                os.chdir("a")
        finally:
            os.chdir(cwd)
        assert "nested more than" in (problem(str(deep)) or "")
        assert mgr.latest().step == 4
        (step, reason), = quarantined(str(tmp_path / "c"))
        assert step == 6 and "nested more than" in reason
    finally:  # what pruning a set-aside folder does; pytest's own cleanup (rmtree) would recurse too
        remove_tree(str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_the_command_line_exits_2_with_one_line(trained: Path, tmp_path: Path, marker: Path) -> None:
    """`seqtrain export` and `seqtrain generate` as a user runs them: exit 2, one line naming the file."""
    step = _planted(trained, tmp_path, "state/.metadata", _payloads(marker, tmp_path)["GLOBAL-dotted-os.system"])
    exe = shutil.which("seqtrain", path=os.path.dirname(sys.executable)) or "seqtrain"
    for args in (["export", str(step), "--format", "hf", "--out", str(tmp_path / "hf")],
                 ["generate", str(step), "--prompt", "a", "--max-new-tokens", "1", "--device", "cpu"]):
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip() and "Warning" not in line
                 and "warnings.warn" not in line and "return func" not in line]
        assert len(lines) == 1 and ".metadata: refused" in lines[0] and "Traceback" not in done.stderr, done.stderr
    _never_ran(marker)
