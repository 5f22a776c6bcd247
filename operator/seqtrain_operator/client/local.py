"""The client's local backend: `Client(local=True)` runs each job as `seqtrain run` in a background process.

A job is its run folder `<root>/<name>/`, the one `seqtrain run` uses: `submitted.yaml` (the document as
submitted), `runner.pid` and `runner.log` (the background `seqtrain run`'s pid and output), and what the local
backend writes there (status.json, events.jsonl, attempts/<K>/rank-<R>.log, metrics.jsonl, checkpoints/). Suspend
stops the runner the way Ctrl-C does (its ranks save first, the status becomes Suspended); resume starts it again
on the same folder, which resumes from the latest checkpoint; delete stops it and removes the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import IO, Any

import yaml

from seqtrain.spec.status import TERMINAL_PHASES, JobStatus
from seqtrain_operator.client.follow import Follower, PodView, Selection
from seqtrain_operator.client.model import ClientError, Event, Job, NotFound
from seqtrain_operator.controller.clock import iso
from seqtrain_operator.local.files import read_status

SUBMITTED, PID_FILE, RUNNER_LOG = "submitted.yaml", "runner.pid", "runner.log"
STOP_GRACE_SECONDS = 60.0  # the runner's own stop: ranks save a checkpoint, then the gang is stopped in order
_RANK_LOG = re.compile(r"rank-(\d+)\.log$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (our own child not yet reaped) has exited
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class LocalJobs:
    def __init__(self, root: str = "runs", poll_seconds: float = 0.5):
        self.root = os.path.abspath(root)
        self.namespace = None
        self.poll = poll_seconds

    def workdir(self, name: str) -> str:
        return os.path.join(self.root, name)

    # ---- the runner process -------------------------------------------------------------------------------------

    def runner_pid(self, name: str) -> int | None:
        """The pid of the job's background `seqtrain run`, when it still runs."""
        try:
            with open(os.path.join(self.workdir(name), PID_FILE), encoding="utf-8") as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def _start(self, name: str) -> None:
        wd = self.workdir(name)
        with open(os.path.join(wd, RUNNER_LOG), "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "seqtrain_operator.cli", "run", os.path.join(wd, SUBMITTED), "--workdir", wd,
                 "--quiet"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        with open(os.path.join(wd, PID_FILE), "w", encoding="utf-8") as f:
            f.write(f"{proc.pid}\n")
        self._child = proc  # reaped when this client goes (no zombie while it lives: `_alive` reads its state)

    def _stop(self, name: str, timeout: float = STOP_GRACE_SECONDS) -> None:
        pid = self.runner_pid(name)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)  # the runner treats SIGTERM as Ctrl-C: checkpoint, stop the gang, Suspended
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    # ---- jobs -------------------------------------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> Job:
        name = body["metadata"]["name"]
        wd = self.workdir(name)
        if os.path.exists(os.path.join(wd, SUBMITTED)) or os.path.exists(os.path.join(wd, "status.json")):
            raise ClientError(f"job {name} already exists (run folder {wd}): delete it first, or submit it under "
                              "another name (--name)")
        os.makedirs(wd, exist_ok=True)
        with open(os.path.join(wd, SUBMITTED), "w", encoding="utf-8") as f:
            yaml.safe_dump(body, f, sort_keys=False)
        self._start(name)
        return self.get(name)

    def get(self, name: str) -> Job:
        wd = self.workdir(name)
        try:
            with open(os.path.join(wd, SUBMITTED), encoding="utf-8") as f:
                doc = yaml.safe_load(f) or {}
            created = iso(datetime.fromtimestamp(os.path.getmtime(os.path.join(wd, SUBMITTED)), timezone.utc))
        except OSError:
            if not os.path.exists(os.path.join(wd, "status.json")):
                raise NotFound(f"job {name}: no run folder {wd}") from None
            doc, created = {}, None
        status = read_status(wd) or JobStatus()
        if status.phase not in TERMINAL_PHASES and status.phase != "Suspended" and self.runner_pid(name) is None \
                and os.path.exists(os.path.join(wd, PID_FILE)):
            status = status.model_copy(update={"phase": "Suspended", "message": "its runner process is not running "
                                               f"(stopped or killed): `seqtrain resume {name}` continues it"})
        spec = dict(doc.get("spec") or {})
        return Job(name=name, namespace=None, status=status, spec=spec, created=created, workdir=wd)

    def find(self, name: str) -> Job | None:
        try:
            return self.get(name)
        except NotFound:
            return None

    def list(self, all_namespaces: bool = False) -> list[Job]:  # one machine: no namespaces
        if not os.path.isdir(self.root):
            return []
        names = sorted(n for n in os.listdir(self.root) if os.path.exists(os.path.join(self.root, n, SUBMITTED))
                       or os.path.exists(os.path.join(self.root, n, "status.json")))
        return [j for n in names if (j := self.find(n)) is not None]

    def delete(self, name: str) -> None:
        self.get(name)  # NotFound when there is nothing to delete
        self._stop(name)
        shutil.rmtree(self.workdir(name), ignore_errors=True)

    def gone(self, name: str, uid: str | None) -> bool:
        return not os.path.exists(self.workdir(name))

    def set_suspend(self, name: str, value: bool) -> Job:
        job = self.get(name)
        if value:
            self._stop(name)
        elif self.runner_pid(name) is None and not job.done:
            self._start(name)
        return self.get(name)

    def events(self, job: Job) -> list[Event]:
        out = []
        try:
            with open(os.path.join(self.workdir(job.name), "events.jsonl"), encoding="utf-8") as f:
                for line in f:
                    with contextlib.suppress(ValueError, AttributeError):
                        e = json.loads(line)
                        out.append(Event(e.get("time"), e.get("type", ""), e.get("reason", ""), e.get("message", "")))
        except OSError:
            pass
        return out

    # ---- logs -------------------------------------------------------------------------------------------------

    def rank_logs(self, job: Job) -> list[PodView]:
        """Each rank's log of each attempt as a PodView (replica = rank: the follower selects by rank); a log is
        'running' while its attempt is the job's live one."""
        base = os.path.join(self.workdir(job.name), "attempts")
        live = not job.done and self.runner_pid(job.name) is not None
        out = []
        for a in sorted(os.listdir(base)) if os.path.isdir(base) else []:
            if not a.isdigit():
                continue
            for f in sorted(os.listdir(os.path.join(base, a))):
                if m := _RANK_LOG.match(f):
                    path = os.path.join(base, a, f)
                    state = "running" if live and int(a) == job.status.attempt else "terminated"
                    out.append(PodView(path, path, int(a), int(m.group(1)), state))
        return out

    def logs(self, name: str, selection: Selection, follow: bool) -> Iterator[str]:
        follower = Follower(selection, follow, lambda rank: (rank,))
        files: dict[str, tuple[IO[bytes], str, bytearray]] = {}
        try:
            while True:
                job = self.find(name)
                views = {v.uid: v for v in self.rank_logs(job)} if job is not None else {}
                todo, done = follower.plan(views.values(), job.phase if job else None,
                                           job.status.attempt if job else 0)
                for o in todo:
                    if (note := follower.announce(o)) is not None:
                        yield note
                    files[o.pod.uid] = (open(o.pod.uid, "rb"), o.prefix, bytearray())  # noqa: SIM115
                moved = False
                for uid, (fh, prefix, buf) in list(files.items()):
                    chunk = fh.read()
                    moved |= bool(chunk)
                    buf += chunk
                    *whole, rest = bytes(buf).split(b"\n")
                    buf[:] = rest
                    for line in whole:
                        follower.line(uid)
                        yield prefix + line.decode("utf-8", "replace")
                    view = views.get(uid)
                    if not chunk and (not follow or view is None or view.state == "terminated"):
                        if buf:
                            yield prefix + bytes(buf).decode("utf-8", "replace")
                        fh.close()
                        del files[uid]
                        follower.closed(uid)
                if done and not files:
                    return
                if not moved and not todo:
                    if not follow and not files:
                        return
                    time.sleep(self.poll)
        finally:
            for fh, _, _ in files.values():
                fh.close()
