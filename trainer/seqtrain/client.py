"""`from seqtrain.client import Client`: submit, follow, wait for and delete SeqTrainJobs, on a cluster or locally.

The implementation lives in the operator package (`seqtrain_operator.client`: it shares the operator's Kubernetes
labels and the local backend's run folders). This module forwards to it on first use, so `import seqtrain.client`
stays torch-free and cheap, and names resolve the same from either import path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from seqtrain_operator.client import (
        Client,
        ClientError,
        Event,
        InvalidJob,
        Job,
        JobEnded,
        NoCluster,
        NotFound,
        Selection,
        WaitTimeout,
    )

__all__ = ["Client", "ClientError", "Event", "InvalidJob", "Job", "JobEnded", "NoCluster", "NotFound", "Selection",
           "WaitTimeout"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import seqtrain_operator.client as impl

    return getattr(impl, name)


def __dir__() -> list[str]:
    return sorted(__all__)
