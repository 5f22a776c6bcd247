"""One decision in the making: its inputs, the status it writes and the actions it queues (`Pass`), and what every
policy of decide() reads from them (where to resume, which nodes to avoid, the size and in-place restarts of a new
gang) or does with them (fail the job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from seqtrain.spec import SeqTrainJob
from seqtrain.spec.status import JobStatus
from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.backoff import backoff_seconds
from seqtrain_operator.controller.clock import iso
from seqtrain_operator.controller.types import Action, DeleteGang, Event, Observed

# How often to look again while waiting for capacity or for a dying gang to disappear.
POLL_SECONDS = 5.0
# Scheduled condition reason of a native gang created unpinned for the node autoscaler (gang_policy.autoscales).
SCALE_UP = "ScaleUpRequested"


@dataclass
class Pass:
    """decide()'s working state: the job, the status being written (a copy), what the backend observed, the one
    clock reading, and the actions queued so far (in the order the backend executes them)."""

    job: SeqTrainJob
    st: JobStatus
    observed: Observed
    now: datetime
    actions: list[Action] = field(default_factory=list)

    @property
    def gang_job(self) -> SeqTrainJob:
        """The job as the live attempt runs it (an elastic gang may run fewer than spec.replicas)."""
        return self.job.with_replicas(self.st.replicas or self.job.spec.replicas)

    def event(self, type_: str, reason: str, message: str) -> None:
        self.actions.append(Event(type_, reason, message))  # type: ignore[arg-type]

    def delete(self, attempt: int, reason: str) -> None:
        """Delete every replica of `attempt`; force it on nodes that are lost (see DeleteGang.force_nodes), and where
        a replica is overdue in Terminating on a Ready node (said in the Terminating condition and an Event)."""
        mine = [r for r in self.observed.replicas if r.attempt == attempt and r.node]
        overdue = sorted({r.node for r in mine if r.overdue and r.node})
        lost = sorted({r.node for r in mine if r.node_lost and r.node} | set(overdue))
        self.actions.append(DeleteGang(attempt, reason, tuple(lost)))
        if overdue:
            replicas = ", ".join(str(r.replica) for r in mine if r.overdue)
            msg = (f"attempt {attempt}: replica(s) {replicas} still terminating on Ready node(s) {', '.join(overdue)} "
                   f"past their grace period (the kubelet did not confirm): force-deleted")
            prev = cond.get(self.st, "Terminating")
            if prev is None or prev.message != msg:
                cond.set_condition(self.st, "Terminating", "True", "TerminationOverdue", msg, self.now)
                self.event("Warning", "ForceDeleted", msg)


def resume_step(ctx: Pass) -> int | None:
    """The newest complete checkpoint the core knows of: observed now, else recorded in the status."""
    ck = ctx.observed.latest_checkpoint or ctx.st.last_checkpoint
    return ck.step if ck is not None else None


def resumes(step: int | None) -> str:
    """Where a new gang (or round) resumes, as the core knows it. The ranks themselves load the newest complete
    checkpoint they find, so a checkpoint nobody reported yet (on Kubernetes the operator sees only what rank 0
    reports, and a save published just before a failure is reported at the next step end, which never comes) is
    not called "none": the trainer's own report says where it resumed (the Resumed condition). Every such message
    holds "from checkpoint step" (the client lists restart events by it)."""
    return f"from checkpoint step {step}" if step else "from checkpoint step ? (the newest the ranks find; none reported yet)"


def avoid(ctx: Pass) -> tuple[str, ...]:
    return tuple(sorted(ctx.st.failed_nodes))


def size_override(ctx: Pass) -> int | None:
    """CreateGang.replicas: the attempt's size when it is not spec.replicas (an elastic gang running smaller)."""
    return ctx.st.replicas if ctx.st.replicas != ctx.job.spec.replicas else None


def in_place_delays(ctx: Pass) -> tuple[float, ...]:
    """The backoff of each in-place restart the new gang's launchers may make: faultTolerance.inPlaceRestarts, at
    most the restart budget left, each delayed as the restart it is counted as would be (backoff_seconds)."""
    st, ft = ctx.st, ctx.job.spec.fault_tolerance
    n = max(0, min(ft.in_place_restarts, ft.max_restarts - st.restarts))
    return tuple(backoff_seconds(ft, st.restarts + st.infra_restarts + k) for k in range(1, n + 1))


def fail(ctx: Pass, reason: str, message: str) -> None:
    """The job ends Failed (terminal: decide() never leaves it)."""
    st = ctx.st
    cond.enter_phase(st, "Failed", reason, message, ctx.now)
    st.completion_time = iso(ctx.now)
    st.next_restart_time = None
    ctx.event("Warning", "Failed", message)
