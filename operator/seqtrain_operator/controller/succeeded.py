"""The success policy executed (JobSet's executeSuccessPolicy): every replica of the live gang exited 0, so the job
is Succeeded (terminal), with the trainer's own stop reason when it ended early on purpose."""

from __future__ import annotations

from seqtrain_operator.controller import conditions as cond
from seqtrain_operator.controller.clock import iso
from seqtrain_operator.controller.context import Pass


def gang_succeeded(ctx: Pass) -> None:
    st = ctx.st
    p = st.progress
    if p is not None and p.stop_reason:  # the trainer ended early on purpose (e.g. EarlyStopped)
        cond.enter_phase(st, "Succeeded", p.stop_reason, f"stopped at step {p.step}: {p.stop_message or ''}", ctx.now)
    else:
        cond.enter_phase(st, "Succeeded", "TrainingComplete", f"trained {ctx.job.spec.training.steps} steps",
                         ctx.now)
    cond.set_condition(st, "Scheduled", "True", "GangRunning", "", ctx.now)
    st.completion_time = iso(ctx.now)
    st.next_restart_time = None
    ctx.event("Normal", "Succeeded", f"training finished after {st.restarts} restart(s)")
