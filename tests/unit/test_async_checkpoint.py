"""Async saves and the layout-independent DCP format, on one process: what the manager publishes, when, and what a
crash or a tampered file leaves behind. (Real rank processes: tests/integration/test_async_checkpoints.py.)"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from seqtrain.checkpoint import CheckpointManager, dcp_format, latest_step
from seqtrain.checkpoint.safe_load import UnusableCheckpoint
from seqtrain.runtime.dist import DistContext
from seqtrain.runtime.launch import free_port


def trainer_files(directory: str) -> list[str]:
    Path(directory, "trainer.pt").write_bytes(b"t")
    return ["trainer.pt"]


def tree(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value)}, "optim": {"state.w.step": torch.tensor(value)},
            "scheduler": {"last_epoch": int(value)}}


def test_a_background_save_writes_what_was_staged_not_what_training_did_next(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext())
    live = tree(1.0)
    info = mgr.save(1, trainer_files, {"loss": 2.0}, state=lambda: live, background=True)
    live["model"]["w"].add_(100.0)  # the next optimizer step, while the write may still run
    mgr.wait()
    assert info is not None and info.path == str(tmp_path / "step-1") and latest_step(str(tmp_path)) == 1
    assert mgr.last_block_seconds is not None and mgr.last_save_seconds is not None
    got = tree(0.0)
    dcp_format.read(str(tmp_path / "step-1" / dcp_format.STATE_DIR), got, None)
    assert torch.equal(got["model"]["w"], torch.full((4, 3), 1.0)) and got["scheduler"]["last_epoch"] == 1


def test_until_the_background_write_is_done_the_previous_checkpoint_stays_the_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="thread")  # the patch below: this process
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.wait()
    release = threading.Event()
    real_write = dcp_format.write

    def slow_write(state: dict, folder: str, group: object) -> None:
        assert release.wait(60)
        real_write(state, folder, group)

    monkeypatch.setattr(dcp_format, "write", slow_write)
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    # training goes on; a crash now would find step-1 as the newest complete checkpoint and a .tmp folder
    assert latest_step(str(tmp_path)) == 1 and (tmp_path / ".tmp-step-2").is_dir()
    release.set()
    mgr.save(3, trainer_files, state=lambda: tree(3.0), background=True)  # waits for step 2 first
    mgr.wait()
    assert sorted(n for n in os.listdir(tmp_path)) == ["step-1", "step-2", "step-3"]


def test_a_failed_background_write_publishes_nothing_and_the_next_save_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="thread")
    mgr.save(1, trainer_files, state=lambda: tree(1.0))  # synchronous
    monkeypatch.setattr(dcp_format, "write", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    with pytest.raises(OSError, match="No space left"):
        mgr.wait()
    assert latest_step(str(tmp_path)) == 1


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def test_a_tampered_dcp_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    """DCP's own reader unpickles `.metadata` in full; seqtrain's never builds anything but DCP's metadata classes."""
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext())
    mgr.save(1, trainer_files, state=lambda: tree(1.0))
    folder = tmp_path / "step-1" / dcp_format.STATE_DIR
    marker = Path(f"/tmp/PWNED-{uuid.uuid4().hex}")
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(Payload(marker), f)
    with pytest.raises(UnusableCheckpoint, match=r"\.metadata: refused.*os\.system|\.metadata: refused.*posix\.system"):
        dcp_format.read(str(folder), tree(0.0), None)
    assert not marker.exists()
    # and the manager's resume check catches the changed file before anything reads it
    assert mgr.latest() is None and (tmp_path / ".bad-step-1").is_dir()


class _ByName:
    """Pickles as Python >= 3.12 pickles an Enum member (the trainer image's Python): getattr(cls, name)."""

    def __init__(self, cls: object, name: str) -> None:
        self.cls, self.name = cls, name

    def __reduce__(self) -> tuple:
        return getattr, (self.cls, self.name)


def test_dcp_metadata_from_python_3_12_enum_members_by_name_loads_and_nothing_else_does() -> None:
    # A checkpoint written in the image (Python 3.13) refused to resume: "it names builtins.getattr".
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from seqtrain.checkpoint.safe_load import _MetadataUnpickler

    def load(obj: object) -> object:
        return _MetadataUnpickler(pickle.dumps(obj)).load()

    member = next(iter(_MEM_FORMAT_ENCODING))
    assert load([_ByName(_MEM_FORMAT_ENCODING, member.name)]) == [member]
    for bad in (_ByName(_MEM_FORMAT_ENCODING, "__class__"), _ByName(_MEM_FORMAT_ENCODING, "mro"),
                _ByName(torch.Size, "count")):
        with pytest.raises(pickle.UnpicklingError, match="not allowed in DCP metadata"):
            load(bad)


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    from seqtrain.runtime.exitcodes import InvalidConfig

    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext())
    mgr.save(1, trainer_files, state=lambda: tree(1.0))
    other = {"model": {"w": torch.zeros(5, 3)}, "optim": {"state.w.step": torch.tensor(0.0)}}
    with pytest.raises(InvalidConfig, match=r"model\.w has shape \[4, 3\] in the checkpoint but \[5, 3\]"):
        dcp_format.read(str(tmp_path / "step-1" / dcp_format.STATE_DIR), other, None)
    with pytest.raises(InvalidConfig, match=r"has no model\.v"):
        dcp_format.read(str(tmp_path / "step-1" / dcp_format.STATE_DIR), {"model": {"v": torch.zeros(1)}}, None)


def test_async_saves_stage_into_the_same_host_buffers_each_time_and_each_save_keeps_its_own_values(
        tmp_path: Path) -> None:
    """Staging reuses its buffers (no new allocation per save: what an async save blocks on), yet every
    published checkpoint holds the values of its own step, and a tensor that changed shape gets a new buffer."""
    manager = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext())
    state = tree(1.0)
    manager.save(1, trainer_files, state=lambda: state, background=True)
    buffers = {k: v.data_ptr() for k, v in manager._stager._buffers.items()}
    state["model"]["w"].fill_(2.0)
    manager.save(2, trainer_files, state=lambda: state, background=True)
    assert {k: v.data_ptr() for k, v in manager._stager._buffers.items()} == buffers
    state["model"]["w"] = torch.full((5, 3), 3.0)  # a resized tensor: its old buffer cannot hold it
    manager.save(3, trainer_files, state=lambda: state, background=True)
    manager.wait()
    assert manager._stager._buffers["/model/w"].shape == (5, 3)
    for step, value, shape in ((1, 1.0, (4, 3)), (2, 2.0, (4, 3)), (3, 3.0, (5, 3))):
        target = {"model": {"w": torch.zeros(shape)}, "optim": {"state.w.step": torch.tensor(0.0)},
                  "scheduler": {"last_epoch": 0}}
        dcp_format.read(str(tmp_path / f"step-{step}" / dcp_format.STATE_DIR), target, None)
        assert torch.equal(target["model"]["w"], torch.full(shape, value)), step
    assert manager.last_wait_seconds is not None


# ---- the writer process (seqtrain.checkpoint.writer) -------------------------------------------------------------


def gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether process `pid` is gone (or a zombie nobody reaps), waiting up to `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def read_state(folder: Path, shape: tuple[int, ...] = (4, 3)) -> dict:
    target = {"model": {"w": torch.zeros(shape)}, "optim": {"state.w.step": torch.tensor(0.0)},
              "scheduler": {"last_epoch": 0}}
    dcp_format.read(str(folder / dcp_format.STATE_DIR), target, None)
    return target


@pytest.mark.slow
def test_the_writer_process_publishes_each_step_with_its_own_values_and_is_gone_after_close(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="process")
    live = tree(1.0)
    mgr.save(1, trainer_files, {"loss": 2.0}, state=lambda: live, background=True)
    assert mgr.writing_in == "process" and mgr._process is not None
    pid = mgr._process.pid
    assert pid is not None and pid != os.getpid()
    live["model"]["w"].fill_(2.0)  # the next optimizer step, while the writer may still read step 1's buffers
    live["scheduler"]["last_epoch"] = 2
    mgr.save(2, trainer_files, state=lambda: live, background=True)  # waits for step 1, stages into the same buffers
    live["model"]["w"].fill_(3.0)
    mgr.close()
    assert latest_step(str(tmp_path)) == 2 and mgr.last_save_seconds is not None
    for step in (1, 2):
        got = read_state(tmp_path / f"step-{step}")
        assert torch.equal(got["model"]["w"], torch.full((4, 3), float(step))), step
        assert got["scheduler"]["last_epoch"] == step
    meta = (tmp_path / "step-1" / "meta.json").read_text()
    assert '"loss": 2.0' in meta and '"sha256"' in meta  # hashed in the writer process
    assert mgr._process is None and gone(pid) and not multiprocessing.active_children()


@pytest.mark.slow
def test_a_failed_write_in_the_writer_process_surfaces_at_the_next_save_and_the_writer_goes_on(
        tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)

    def blocked(directory: str) -> list[str]:
        Path(directory, dcp_format.STATE_DIR).write_text("a file where the writer makes its folder")
        return trainer_files(directory)

    mgr.save(2, blocked, state=lambda: tree(2.0), background=True)
    pid = mgr._process.pid if mgr._process else None
    with pytest.raises(RuntimeError, match=r"(?s)checkpoint write failed: .*File exists.*state"):
        mgr.save(3, trainer_files, state=lambda: tree(3.0), background=True)
    assert latest_step(str(tmp_path)) == 1 and (tmp_path / ".tmp-step-2").is_dir()
    mgr.save(3, trainer_files, state=lambda: tree(3.0), background=True)  # the same writer process
    assert mgr._process is not None and mgr._process.pid == pid
    mgr.close()
    assert latest_step(str(tmp_path)) == 3 and torch.equal(read_state(tmp_path / "step-3")["model"]["w"],
                                                            torch.full((4, 3), 3.0))


@pytest.mark.slow
def test_a_writer_process_that_dies_fails_the_next_wait_and_the_next_save_starts_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the writer's environment is the rank's at its start: step 2's write then waits in faults.in_save
    monkeypatch.setenv("SEQTRAIN_FAULT_IN_SAVE", "sleep:60")
    monkeypatch.setenv("SEQTRAIN_FAULT_SAVE_STEP", "2")
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.wait()
    assert mgr._process is not None
    first = mgr._process.pid
    assert first is not None
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    os.kill(first, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=rf"writer process \(pid {first}\) died \(signal 9\)"):
        mgr.wait()
    assert latest_step(str(tmp_path)) == 1
    mgr.save(3, trainer_files, state=lambda: tree(3.0), background=True)
    assert mgr._process is not None and mgr._process.pid != first
    mgr.close()
    assert latest_step(str(tmp_path)) == 3


@pytest.mark.slow
def test_an_idle_writer_process_that_does_not_answer_is_killed_and_replaced(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=DistContext(), writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.wait()
    assert mgr._process is not None
    first = mgr._process.pid
    assert first is not None and mgr._process.alive()
    os.kill(first, signal.SIGSTOP)  # hung
    assert not mgr._process.alive(timeout_s=0.5) and mgr._process.ended() == "no answer within 0.5 s, killed"
    assert gone(first)
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    assert mgr._process is not None and mgr._process.pid != first
    mgr.close()
    assert latest_step(str(tmp_path)) == 2


def _crash_in_the_writer(directory: str, pid_file: str) -> None:
    """A rank whose step-2 write is cut: SEQTRAIN_FAULT_IN_SAVE=crash kills the rank from its writer process."""
    os.environ.update(SEQTRAIN_FAULT_IN_SAVE="crash", SEQTRAIN_FAULT_SAVE_STEP="2")  # as a rank's is set at start
    mgr = CheckpointManager(directory, keep=3, ctx=DistContext(), writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.wait()
    assert mgr._process is not None
    Path(pid_file).write_text(str(mgr._process.pid))
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    mgr.wait()  # never returns: the writer kills this process after step 2's state is written, before publishing
    os._exit(3)


@pytest.mark.slow
def test_a_rank_killed_during_its_background_write_leaves_the_previous_checkpoint_the_latest_and_no_writer(
        tmp_path: Path) -> None:
    rank = multiprocessing.get_context("spawn").Process(target=_crash_in_the_writer,
                                                        args=(str(tmp_path / "ckpt"), str(tmp_path / "writer.pid")))
    rank.start()
    rank.join(120)
    assert rank.exitcode == -signal.SIGKILL
    assert latest_step(str(tmp_path / "ckpt")) == 1
    assert (tmp_path / "ckpt" / ".tmp-step-2" / dcp_format.STATE_DIR / ".metadata").is_file()  # written, not published
    assert gone(int((tmp_path / "writer.pid").read_text()))  # the writer died with its rank
    mgr = CheckpointManager(str(tmp_path / "ckpt"), keep=3, ctx=DistContext())
    latest = mgr.latest()
    assert latest is not None and latest.step == 1


def test_a_state_too_big_for_dev_shm_is_written_by_the_thread_with_a_one_line_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tmpfs past its size kills the process touching the page (SIGBUS): the writer process is not used then."""
    from seqtrain.checkpoint import writer

    assert writer.unsupported(tree(1.0), 1) is None
    # as many ranks on this node as make /dev/shm too small for them all
    ctx = DistContext(local_world_size=10**15)
    mgr = CheckpointManager(str(tmp_path), keep=3, ctx=ctx, writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
    mgr.close()
    assert mgr.writing_in.startswith("thread (/dev/shm has") and mgr._process is None
    assert not mgr._stager.shared
    said = [line for line in capsys.readouterr().out.splitlines() if "async checkpoint writes run in a thread" in line]
    assert len(said) == 1 and "raise spec.resources.shmSize" in said[0], said
    assert latest_step(str(tmp_path)) == 2 and torch.equal(read_state(tmp_path / "step-2")["model"]["w"],
                                                            torch.full((4, 3), 2.0))


def _two_ranks(rank: int, port: int, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    ctx = DistContext(rank=rank, world_size=2, dp_rank=rank, dp_size=2, backend="gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mgr = CheckpointManager(directory, keep=3, ctx=ctx, writer="process")
    for step in (1, 2):
        # a replicated tensor (DCP writes one copy), one of each rank's own, and a sharded one (FSDP2's kind): rows
        # 0-1 on rank 0, 2-3 on rank 1
        shard = DTensor.from_local(torch.full((2, 3), step * 100.0 + rank), mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size([4, 3]), stride=(3, 1))
        live = {"model": {"w": torch.full((4, 3), float(step)), f"r{rank}": torch.full((2,), step * 10.0 + rank),
                          "s": shard},
                "optim": {"state.w.step": torch.tensor(float(step))}}
        mgr.save(step, trainer_files, state=lambda live=live: live, background=True)
        live["model"]["w"].fill_(-1.0)  # training goes on
    where, pid = mgr.writing_in, mgr._process.pid if mgr._process else None
    mgr.close()
    Path(out, f"rank{rank}").write_text(f"{where} {gone(pid) if pid else None}")
    torch.distributed.barrier()  # neither rank tears its pairs down while the other still uses them (SIGABRT)
    torch.distributed.destroy_process_group()
    os._exit(0)  # as the trainer's entry leaves (gloo's threads can abort the interpreter's shutdown)


@pytest.mark.slow
def test_two_ranks_write_through_their_writer_processes_and_rank_0_publishes_sharded_tensors_too(
        tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    mp.spawn(_two_ranks, args=(port, str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):  # both wrote in a process, and no writer is left
        assert (tmp_path / f"rank{rank}").read_text().split() == ["process", "True"], rank
    assert latest_step(str(tmp_path / "ckpt")) == 2
    for step in (1, 2):
        got = {"model": {"w": torch.zeros(4, 3), "r0": torch.zeros(2), "r1": torch.zeros(2), "s": torch.zeros(4, 3)},
               "optim": {"state.w.step": torch.tensor(0.0)}}
        dcp_format.read(str(tmp_path / "ckpt" / f"step-{step}" / dcp_format.STATE_DIR), got, None)
        assert torch.equal(got["model"]["w"], torch.full((4, 3), float(step)))
        assert got["model"]["s"][:, 0].tolist() == [step * 100.0] * 2 + [step * 100.0 + 1] * 2
        assert got["model"]["r0"].tolist() == [step * 10.0] * 2 and got["model"]["r1"].tolist() == [step * 10.0 + 1] * 2


def _idle_writer_killed(rank: int, port: int, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    ctx = DistContext(rank=rank, world_size=2, dp_rank=rank, dp_size=2, backend="gloo")
    mgr = CheckpointManager(directory, keep=3, ctx=ctx, writer="process")
    mgr.save(1, trainer_files, state=lambda: tree(1.0), background=True)
    mgr.wait()
    pid = mgr._process.pid if mgr._process else None
    assert pid is not None
    if rank == 1:  # no waiting for it to be gone: the kernel may still be tearing it down when the next save asks
        os.kill(pid, signal.SIGKILL)
    torch.distributed.barrier()
    started = time.monotonic()
    try:
        mgr.save(2, trainer_files, state=lambda: tree(2.0), background=True)
        got = "saved"
    except RuntimeError as exc:
        got = str(exc)
    took = time.monotonic() - started
    mgr.close()  # rank 0 stops its live writer
    Path(out, f"rank{rank}").write_text(f"{took:.3f} {gone(pid)} {got}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_a_writer_process_killed_while_idle_fails_the_next_save_on_every_rank_and_the_previous_checkpoint_stays(
        tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    port = free_port()
    ranks = mp.spawn(_idle_writer_killed, args=(port, str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ranks.join(1):  # a rank that hangs fails the test instead of stalling it
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            pytest.fail("the ranks hung after a writer process was killed")
    for rank in (0, 1):
        took, writer_gone, got = (tmp_path / f"rank{rank}").read_text().split(" ", 2)
        how = r" \(signal 9\)" if rank == 1 else ""
        assert re.fullmatch(rf"rank {rank}: the checkpoint writer process of rank 1 died while idle{how}: "
                            r"checkpoint step-2 is not saved on any rank; step-1 stays the latest checkpoint", got), got
        assert float(took) < 30 and writer_gone == "True", (rank, took, writer_gone)
    assert latest_step(str(tmp_path / "ckpt")) == 1 and not (tmp_path / "ckpt" / "step-2").exists()
