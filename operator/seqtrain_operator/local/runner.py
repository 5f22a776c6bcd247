"""`seqtrain run FILE`: run a job on this machine through the controller core.

The loop is the same as the operator's reconcile, with processes for pods: observe the gang (rank processes,
checkpoints, metrics.jsonl) -> decide() -> persist status.json -> execute actions (start/stop the gang) -> repeat.

Re-running on the same workdir: a job that Succeeded (and is not asked for more steps) is reported as already
finished (exit 0); anything else resumes from the latest complete checkpoint. A Failed job that is run again gets a
fresh restart budget (the user has presumably fixed the cause); restart counts of an unfinished job carry over.
A re-run with a training.steps that the trainer would refuse at resume (the newest checkpoint was made for other
steps and the schedule's next learning rate moves; see `resume_problem`) exits 2 with the trainer's line before any
rank starts, and the run folder keeps its phase.

One runner owns a run folder at a time: it holds an exclusive `flock` on `<workdir>/run.lock` for its whole life
(the pid inside names it). A second `seqtrain run` on the folder exits 2 naming that pid instead of stopping the
first one's ranks; the kernel drops the lock when its holder dies however it dies, so a lock left by a killed runner
is taken over (and said so).

Ctrl-C (or SIGTERM to the runner) stops the gang gracefully (the trainer finishes its step and saves a checkpoint)
and leaves the job **Suspended**, exit code 130: nothing went wrong with the job, it is resumable, and Suspended is
the phase that says exactly that (Failed would be terminal and blame the job).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

import yaml

from seqtrain.checkpoint import discovery
from seqtrain.checkpoint.discovery import quarantined
from seqtrain.optim.schedules import resume_steps_change
from seqtrain.spec import SeqTrainJob, resolve
from seqtrain.spec.cluster import quantity_value
from seqtrain.spec.init_source import TOKENIZER_COMPANIONS
from seqtrain.spec.memory import AUTO_CHOICE, AUTO_MARKER
from seqtrain.spec.runtime import RuntimeConfig, write_trainer_config
from seqtrain.spec.status import TERMINAL_PHASES, JobStatus, Layout, Progress
from seqtrain_operator.controller import CreateGang, DeleteGang, Event, Observed, decide, utcnow
from seqtrain_operator.controller.checkpoint_policy import failure_history
from seqtrain_operator.controller.conditions import enter_phase
from seqtrain_operator.controller.types import ReplicaObservation
from seqtrain_operator.local.display import ProgressView, StartupWatch, plot_loss, run_throughput
from seqtrain_operator.local.files import (
    MetricsTail,
    atomic_write_text,
    latest_checkpoint,
    read_metrics,
    read_status,
    trainer_checkpoint_report,
    with_trainer_progress,
    write_status,
)
from seqtrain_operator.local.gang import TERM_GRACE_SECONDS, LocalGang, kill_leftovers
from seqtrain_operator.local.memory_limit import MemoryLimit
from seqtrain_operator.planner import local_plan
from seqtrain_operator.planner.fit import memory_problems
from seqtrain_operator.planner.show import load_or_say, say_problems

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 130
POLL_SECONDS = 0.2
RANK_MTBF_ENV = "SEQTRAIN_RANK_MTBF_HOURS"  # local runs' counterpart of the chart's operator.rankMtbfHours
FAILURE_TEARDOWN_GRACE = 10.0  # after a rank died the others cannot save anyway (their collectives fail)


def run_file(path: str, workdir: str | None = None, overrides: Sequence[str] = (), quiet: bool = False) -> int:
    """Load and validate FILE (+ --set overrides), then run it locally. Exit code: 0 Succeeded (or already
    finished), 1 Failed, 2 invalid spec (one `FILE: path: message` line per problem on stderr, nothing written),
    130 interrupted (job left Suspended, resumable)."""
    job = load_or_say(path, overrides)
    if job is None:
        return EXIT_INVALID
    problem = _local_problem(job)
    if problem is not None:
        return say_problems(path, [problem])
    if problems := memory_problems(job):  # the verdict `validate` and `plan` give: the same estimate, the same line
        return say_problems(path, problems)
    prior = os.environ.get(RANK_MTBF_ENV, "").strip()
    try:
        rank_mtbf_hours = float(prior) if prior else None
        if rank_mtbf_hours is not None and not 0 < rank_mtbf_hours < float("inf"):
            raise ValueError
    except ValueError:
        print(f"{RANK_MTBF_ENV}={prior!r}: must be a positive number of hours (the MTBF of one rank, the prior of "
              "checkpoint.intervalSteps: auto), or unset", file=sys.stderr)
        return EXIT_INVALID
    flag = "--workdir" if workdir else f"the default run folder (runs/{job.name})"
    workdir = os.path.abspath(workdir or os.path.join("runs", job.name))
    problem = folder_problem(flag, workdir)
    if problem is not None:
        return say_problems(path, [problem])
    return LocalRun(job, workdir, quiet, rank_mtbf_hours).run()


def folder_problem(what: str, folder: str) -> str | None:
    """None when `folder` is, or has just been created as, a folder this process can write in; else one line naming
    `what` and the fix (no traceback for a path argument)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        return f"{what} {folder}: exists and is not a folder; name a folder (it is created when absent)"
    except NotADirectoryError:
        return f"{what} {folder}: a part of the path is a file, not a folder; name a folder"
    except OSError as exc:
        return f"{what} {folder}: cannot create the folder ({exc.strerror}); name a folder you can write to"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{what} {folder}: no permission to write in it; name a folder you can write to"
    return None


LOCK_FILE = "run.lock"


class RunFolderBusy(Exception):
    """Another live runner holds the run folder's lock."""

    def __init__(self, pid: int | None) -> None:
        super().__init__(pid)
        self.pid = pid


class RunLock:
    """The exclusive lock a runner holds on its run folder: `flock` on `<workdir>/run.lock`, whose content is the
    holder's pid (for the message a second runner prints). A runner that ends in order empties the file before it
    unlocks, so a pid found in a file we could lock belongs to a runner that died holding it. The file is never
    deleted: deleting it would let two runners lock two different files of the same name."""

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> int | None:
        """Take the lock, or raise RunFolderBusy(holder pid). Returns the pid of a dead holder whose lock was taken
        over, else None. The descriptor is close-on-exec: rank processes never hold the lock."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise RunFolderBusy(holder) from None
        except BaseException:
            os.close(fd)
            raise
        stale = _pid_in(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return stale if stale != os.getpid() else None

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor drops the flock


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def tokenizer_file(job: SeqTrainJob) -> str | None:
    """The tokenizer.json a (resolved) job trains with: data.tokenizer's file, or the one a `prepare-data` folder's
    index.json names; None for byte-level and synthetic data."""
    data = job.spec.data
    if data.source == "synthetic":
        return None
    if data.source == "tokens":
        for folder in data.paths:
            try:
                with open(os.path.join(os.path.expanduser(folder), "index.json"), encoding="utf-8") as f:
                    described = json.load(f).get("tokenizer") or {}
            except (OSError, ValueError, AttributeError):
                continue
            if described.get("type") == "file" and described.get("path"):
                return os.path.abspath(os.path.expanduser(str(described["path"])))
            return None
    if data.tokenizer.type == "file" and data.tokenizer.path:
        return os.path.abspath(os.path.expanduser(data.tokenizer.path))
    return None


def keep_tokenizer(job: SeqTrainJob, workdir: str) -> str | None:
    """Copy the job's tokenizer file into the run folder as tokenizer.json, so that the folder is self-contained:
    `export` and `generate` take a tokenizer only from inside the folder they read (its records may not point
    elsewhere), and the file the run trained with stays with its checkpoints. Returns a problem line or None."""
    src = tokenizer_file(job)
    if src is None:
        return None
    dst = os.path.join(workdir, "tokenizer.json")
    try:
        with open(src, "rb") as f:
            data = f.read()
    except OSError as exc:
        return f"spec.data.tokenizer: cannot read {src} ({exc.strerror}); name a readable tokenizer.json"
    try:
        with open(dst, "rb") as f:
            if f.read() == data:
                return None
    except OSError:
        pass
    tmp = f"{dst}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)
    for name in TOKENIZER_COMPANIONS:  # special tokens and chat template beside it travel with it (export)
        near = os.path.join(os.path.dirname(src), name)
        if os.path.isfile(near) and not os.path.islink(near):
            shutil.copyfile(near, os.path.join(workdir, name))
    return None


def resume_problem(job: SeqTrainJob, checkpoint_dir: str) -> str | None:
    """The refusal a rank would end with when it resumes from the newest complete checkpoint (the trainer's own
    check of training.steps against the steps the checkpoint was made for), made before any rank starts: a refused
    change exits 2 with the rank's line and leaves the run folder, a Succeeded one included, as it was."""
    info = discovery.latest_checkpoint(checkpoint_dir)
    if info is None:
        return None
    change = resume_steps_change(resolve(job).spec.training, info.step, info.meta.get("total_steps"))
    return f"spec.training.steps: {change[0]}" if change is not None and change[1] else None


def _local_problem(job: SeqTrainJob) -> str | None:
    ck = job.spec.checkpoint.path
    if ck and "://" in ck:
        return f"spec.checkpoint.path: {ck!r} is a remote URI; local runs need a folder path (or leave it unset)"
    return None


def visible_gpus() -> int:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


class LocalRun:
    def __init__(self, job: SeqTrainJob, workdir: str, quiet: bool, rank_mtbf_hours: float | None = None):
        self.job = job
        self.rank_mtbf_hours = rank_mtbf_hours  # the chart's operator.rankMtbfHours for local runs (None: default)
        self.workdir = workdir
        self.quiet = quiet
        self.ckpt_dir = os.path.abspath(job.spec.checkpoint.path or os.path.join(workdir, "checkpoints"))
        self.gang: LocalGang | None = None
        self.last_failed: ReplicaObservation | None = None
        self.tail = MetricsTail(os.path.join(workdir, "metrics.jsonl"))
        self.status: JobStatus | None = None  # the loop's latest status: what an interruption starts from
        self.startup: StartupWatch | None = None
        self.memory_warned = False
        self.limit = MemoryLimit(job.spec.resources.memory)  # resources.memory, enforced as a pod's limit is
        self._auto_said: dict[int, tuple[int, str]] = {}  # attempt -> microBatchSize auto's choice and reason

    # ---- entry --------------------------------------------------------------------------------------------------

    def run(self) -> int:
        job = self.job
        os.makedirs(self.workdir, exist_ok=True)
        lock = RunLock(self.workdir)
        try:
            stale = lock.acquire()
        except RunFolderBusy as busy:
            who = f"pid {busy.pid}" if busy.pid is not None else "a process that is starting"
            print(f"{job.name}: run folder {self.workdir} is in use by another seqtrain run ({who}, lock "
                  f"{lock.path}); wait for it to end, stop it (Ctrl-C there, or kill -INT {busy.pid or 'PID'}), or "
                  "pass another --workdir", file=sys.stderr)
            return EXIT_INVALID
        try:
            if stale is not None:
                print(f"{job.name}: took over run folder {self.workdir} from pid {stale}, which ended without "
                      "releasing it", file=sys.stderr)
            return self._run_locked()
        finally:
            lock.release()

    def _run_locked(self) -> int:
        job, steps = self.job, self.job.spec.training.steps
        prev = read_status(self.workdir)
        done = prev.progress.step if prev and prev.progress else 0
        stopped_early = bool(prev and prev.progress and prev.progress.stop_reason)
        if prev is not None and prev.phase == "Succeeded" and (done >= steps or stopped_early):
            print(f"{job.name}: already finished (Succeeded at step {done}/{steps}"
                  f"{', ' + prev.completion_time if prev.completion_time else ''}); run folder {self.workdir}. "
                  "Nothing to do.")
            return EXIT_OK
        need = job.spec.replicas * job.spec.resources.gpus
        if need and (have := visible_gpus()) < need:
            print(f"{job.name}: spec.resources.gpus: needs {job.spec.replicas} x {job.spec.resources.gpus} = {need} "
                  f"GPU(s), this machine has {have}; use resources.gpus: 0 to train on the CPU", file=sys.stderr)
            return EXIT_FAILED
        if (problem := folder_problem("spec.checkpoint.path", self.ckpt_dir)) is not None:
            print(f"{job.name}: {problem}", file=sys.stderr)
            return EXIT_INVALID
        if (problem := resume_problem(job, self.ckpt_dir)) is not None:  # before anything in the folder changes
            print(f"{job.name}: {problem}", file=sys.stderr)
            return EXIT_INVALID
        recorded = job.model_copy(deep=True)  # as submitted, with the tokenizer it trains with (model.init's)
        recorded.spec.data.tokenizer = resolve(job).spec.data.tokenizer
        atomic_write_text(os.path.join(self.workdir, "job.yaml"), yaml.safe_dump(recorded.to_dict(), sort_keys=False))
        if (problem := keep_tokenizer(resolve(job), self.workdir)) is not None:
            print(f"{job.name}: {problem}", file=sys.stderr)
            return EXIT_INVALID
        if kill_leftovers(self._gang_file()):
            print(f"{job.name}: stopped rank processes left behind by an earlier run", file=sys.stderr)
        status = self._initial_status(prev)
        write_status(self.workdir, status)
        if not self.quiet and not self.limit.enforced:
            print(f"{job.name}: resources.memory {job.spec.resources.memory} per replica cannot be enforced on this "
                  "system (no /proc); the ranks' peak memory is checked against it as they train", file=sys.stderr)
        started = time.monotonic()
        with _sigterm_as_interrupt(), ProgressView(job.name, steps, self.quiet) as view:
            try:
                status = self._loop(status, view)
            except KeyboardInterrupt:
                return self._interrupted(self.status or status, view)
            finally:
                if self.gang is not None:
                    self._stop_gang(TERM_GRACE_SECONDS)
        return self._finish(status, time.monotonic() - started, view)

    def _initial_status(self, prev: JobStatus | None) -> JobStatus:
        st = prev.model_copy(deep=True) if prev is not None else JobStatus()
        if prev is not None:
            if prev.phase == "Failed":
                st.restarts, st.infra_restarts = 0, 0
            if prev.phase != "Pending":
                st.completion_time = None
                st.next_restart_time = None
                enter_phase(st, "Pending", "Resumed", f"run again on {self.workdir}", utcnow())
        layout = local_plan(self.job).layout
        st.layout = Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp)
        return st

    # ---- reconcile loop -----------------------------------------------------------------------------------------

    def _loop(self, status: JobStatus, view: ProgressView) -> JobStatus:
        while True:
            replicas = self.gang.observe() if self.gang is not None else ()
            if self.gang is not None:
                self._record_gang()  # a multi-rank replica's launcher reports its ranks' pids after starting them
                replicas = tuple(self.limit.observed(r) for r in replicas)  # killed by the limit: as OOMKilled
                for why in self.limit.watch(self.gang.attempt, self.gang.members):
                    view.line(f"{self.job.name}: {why}", always=True)
            for r in replicas:
                if r.phase == "Failed":
                    self.last_failed = r
            progress = with_trainer_progress(self.tail.progress(), os.path.join(self.workdir, "progress.json"))
            if progress is not None and (said := self._auto_batch()) is not None:
                progress = progress.model_copy(update={"micro_batch_size": said[0], "micro_batch_reason": said[1]})
            policy, at_risk = trainer_checkpoint_report(os.path.join(self.workdir, "progress.json"))
            observed = Observed(replicas=replicas, latest_checkpoint=latest_checkpoint(self.ckpt_dir),
                                progress=progress, skipped_checkpoints=tuple(quarantined(self.ckpt_dir)),
                                checkpoint_policy=policy, work_at_risk=at_risk)
            now = utcnow()
            d = decide(self.job, status, observed, now)
            if d.status != status:
                write_status(self.workdir, d.status)
            status = self.status = d.status
            for action in d.actions:
                if isinstance(action, CreateGang):
                    self._start_gang(action, status)
                elif isinstance(action, DeleteGang) and self.gang is not None and self.gang.attempt == action.attempt:
                    self._stop_gang(TERM_GRACE_SECONDS if action.reason == "Suspended" else FAILURE_TEARDOWN_GRACE)
            for ev in d.of(Event):
                self._event(ev, view)
            self._follow_startup(view)
            self._check_memory(view)
            p = status.progress
            if p is not None:
                view.update(p.step, p.loss, p.tokens_per_second)
            if status.phase in TERMINAL_PHASES or status.phase == "Suspended":
                return status
            time.sleep(POLL_SECONDS)

    def _check_memory(self, view: ProgressView) -> None:
        """Say once, as soon as it happens, that the ranks' peak memory passed resources.memory: on Kubernetes the
        replica would have been OOM-killed (locally nothing enforces the limit)."""
        rec = self.tail.last
        peak = rec.get("mem_peak_mb") if rec else None
        if self.memory_warned or not isinstance(peak, int | float):
            return
        res = self.job.spec.resources
        limit_mb = float(quantity_value(res.memory)) / 2**20
        need_mb = peak * res.procs  # the busiest rank's peak, for each rank of a replica
        if need_mb > limit_mb:
            self.memory_warned = True
            ranks = f"{res.procs} ranks x {peak:,.0f} MiB" if res.procs > 1 else f"{peak:,.0f} MiB"
            view.line(f"{self.job.name}: memory per replica reached {ranks} (the busiest rank's peak, step "
                      f"{rec.get('step') if rec else '?'}), over resources.memory {res.memory} "
                      f"({limit_mb:,.0f} MiB): a pod with this limit would be OOM-killed; raise resources.memory "
                      "(seqtrain plan estimates it)", always=True)

    def _auto_batch(self) -> tuple[int, str] | None:
        """training.microBatchSize auto: the size rank 0 of the running attempt chose, and why (its log line)."""
        if self.job.spec.training.micro_batch_size != "auto" or self.gang is None:
            return None
        key = self.gang.attempt
        if self._auto_said.get(key) is None:
            try:
                with open(os.path.join(self.workdir, "attempts", str(key), "rank-0.log"), encoding="utf-8",
                          errors="replace") as f:
                    line = next((ln for ln in f if ln.startswith(AUTO_MARKER)), None)
            except OSError:
                line = None
            m = AUTO_CHOICE.search(line or "")
            if line is None or m is None:
                return self._auto_said.get(key - 1)  # until this attempt says, the previous one's stands
            self._auto_said[key] = (int(m.group(1)), line[len(AUTO_MARKER):].strip())
        return self._auto_said[key]

    def _follow_startup(self, view: ProgressView) -> None:
        if self.startup is None or self.startup.view is not view:
            self.startup = StartupWatch(view)
        log = os.path.join(self.workdir, "attempts", str(self.gang.attempt), "rank-0.log") if self.gang else None
        t = self.tail.last.get("time") if self.tail.last else None
        self.startup.follow(log, float(t) if isinstance(t, int | float) else None)

    def _start_gang(self, action: CreateGang, status: JobStatus) -> None:
        job = resolve(self.job)
        if action.replicas is not None:
            job = job.with_replicas(action.replicas)
        adir = os.path.join(self.workdir, "attempts", str(action.attempt))
        os.makedirs(adir, exist_ok=True)
        cfg = os.path.join(adir, "config.json")
        # Ports 0: every rank serves /metrics (rank 0 also progress) on a free port, noted in <workdir>/endpoints/.
        write_trainer_config(cfg, job, RuntimeConfig(workdir=self.workdir, checkpoint_dir=self.ckpt_dir,
                                                     attempt=action.attempt, metrics_port=0, progress_port=0,
                                                     failure_history=failure_history(status, self.rank_mtbf_hours)))
        res = job.spec.resources
        self.gang = LocalGang.start(action.attempt, job.spec.replicas, res.procs, res.gpus, cfg, adir,
                                    in_place_delays=action.in_place_delays)
        self._record_gang()

    def _stop_gang(self, grace: float) -> None:
        assert self.gang is not None
        try:
            self.gang.stop(grace)
        except KeyboardInterrupt:  # a second Ctrl-C: no more patience
            self.gang.stop(0)
            raise
        finally:
            self.gang = None
            with suppress(OSError):
                os.unlink(self._gang_file())

    def _record_gang(self) -> None:
        assert self.gang is not None
        text = self.gang.to_json()
        if text != getattr(self, "_gang_written", None):
            atomic_write_text(self._gang_file(), text)
            self._gang_written = text

    def _gang_file(self) -> str:
        return os.path.join(self.workdir, "gang.json")

    def _event(self, ev: Event, view: ProgressView) -> None:
        message = ev.message
        if ev.reason == "RestartedInPlace" and self.gang is not None:
            # the replica processes live on through an in-place restart: their launchers' logs name the rank
            causes = self.gang.rank_failures()
            message += f"; cause: {'; '.join(causes)}" if causes else "; cause: not reported by the launcher"
        rec = {"time": utcnow().isoformat(), "type": ev.type, "reason": ev.reason, "message": message}
        with open(os.path.join(self.workdir, "events.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        view.line(f"[{ev.type}] {ev.reason}: {message}", always=ev.type == "Warning")

    # ---- endings ------------------------------------------------------------------------------------------------

    def _interrupted(self, status: JobStatus, view: ProgressView) -> int:
        view.line("interrupted: stopping the gang (ranks save a checkpoint first) ...", always=True)
        if self.gang is not None:
            with suppress(KeyboardInterrupt):
                self._stop_gang(TERM_GRACE_SECONDS)
        ck = latest_checkpoint(self.ckpt_dir)
        last = self.tail.poll()  # steps the ranks wrote after the loop's last pass (and while they stopped)
        st = status.model_copy(deep=True)
        if ck is not None:
            st.last_checkpoint = ck
        step = max(st.progress.step if st.progress else 0, int(last["step"]) if last else 0)
        where = f"checkpoint step {ck.step}" if ck else "the start (no checkpoint yet)"
        enter_phase(st, "Suspended", "Interrupted", f"interrupted at step {step}; run the same command again to "
                    f"resume from {where}", utcnow())
        write_status(self.workdir, st)
        view.line(f"{self.job.name}: Suspended. {st.message}", always=True)
        return EXIT_INTERRUPTED

    def _finish(self, status: JobStatus, elapsed: float, view: ProgressView) -> int:
        name, p = self.job.name, status.progress
        if status.phase == "Suspended":
            view.line(f"{name}: Suspended ({status.message}); run folder {self.workdir}", always=True)
            return EXIT_OK
        if status.phase == "Succeeded":
            skipped = plot_loss(os.path.join(self.workdir, "metrics.jsonl"), os.path.join(self.workdir, "loss.png"),
                                f"{name}: training loss")
            if skipped:
                view.line(f"loss plot skipped: {skipped}", always=True)
            loss = f"{p.loss:.4f}" if p and p.loss is not None else "-"
            view.line(f"{name}: Succeeded at step {p.step if p else 0}/{self.job.spec.training.steps}, loss {loss}, "
                      f"{self._throughput(p)}, {status.restarts} restart(s), {elapsed:.0f}s; run folder "
                      f"{self.workdir}", always=True)
            return EXIT_OK
        view.line(f"{name}: Failed: {status.message}", always=True)
        if self.last_failed is not None:
            log = _log_of(self.last_failed)
            if log:
                view.line(f"--- last lines of {log} ---\n{_tail(log, 20)}", always=True)
        return EXIT_FAILED

    def _throughput(self, p: Progress | None) -> str:
        """'2,012 tok/s average (last step 1,693)': the run's average from metrics.jsonl, the last step's labelled."""
        average, last = run_throughput(read_metrics(os.path.join(self.workdir, "metrics.jsonl")))
        if average is None:
            average = p.tokens_per_second if p else None
        if average is None:
            return "- tok/s"
        return f"{average:,.0f} tok/s average" + (f" (last step {last:,.0f})" if last is not None else "")


def _log_of(r: ReplicaObservation) -> str | None:
    marker = "; log "
    return r.message.split(marker, 1)[1] if marker in r.message else None


def _tail(path: str, n: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:]).rstrip()
    except OSError:
        return "(log not readable)"


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM to the runner behaves like Ctrl-C: stop the gang in order instead of orphaning it."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
