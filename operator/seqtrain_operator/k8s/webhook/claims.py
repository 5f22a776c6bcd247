"""Whether a job's checkpoint claim can serve its gang (pure): a ReadWriteOnce volume attaches to one node at a time,
so the replicas of a multi-node gang on other nodes wait in ContainerCreating for ever (Multi-Attach error), and a
ReadWriteOncePod claim admits one pod in the whole cluster. Checked by the admission webhook, which reads the claim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from seqtrain.spec import SeqTrainJob


def access_modes(claim: Mapping[str, Any]) -> list[str]:
    """What the bound volume grants (status), else what the claim asks (spec)."""
    return list((claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes") or [])


def claim_problem(job: SeqTrainJob, claim: Mapping[str, Any] | None) -> str | None:
    """Why `checkpoint.pvc` cannot serve the gang (None: it can, or the claim does not exist yet)."""
    name, replicas = job.spec.checkpoint.pvc, job.spec.replicas
    if not name or claim is None or replicas < 2:
        return None
    modes = access_modes(claim)
    if not modes or "ReadWriteMany" in modes:
        return None
    return (f"spec.checkpoint.pvc: claim {name} is {'/'.join(modes)}: the {replicas} replicas of the gang run on "
            f"several nodes, and such a volume attaches to one node (one pod for ReadWriteOncePod), so the others "
            f"would wait in ContainerCreating (Multi-Attach error); use a ReadWriteMany claim (NFS, CephFS, EFS, "
            f"Filestore, Azure Files) or replicas: 1")
