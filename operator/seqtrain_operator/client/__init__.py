"""The seqtrain client (import it as `seqtrain.client`): SeqTrainJobs on a cluster or locally, from Python.

The Kubernetes and local backends are imported by `Client(...)` when it is built, so importing this package needs
neither a cluster nor torch.
"""

from seqtrain_operator.client.api import Client, prepare
from seqtrain_operator.client.follow import Selection
from seqtrain_operator.client.model import (
    ClientError,
    Event,
    InvalidJob,
    Job,
    JobEnded,
    NoCluster,
    NotFound,
    WaitTimeout,
)

__all__ = ["Client", "ClientError", "Event", "InvalidJob", "Job", "JobEnded", "NoCluster", "NotFound", "Selection",
           "WaitTimeout", "prepare"]
