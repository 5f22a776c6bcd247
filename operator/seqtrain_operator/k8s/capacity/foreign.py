"""Other tenants' pods (those without the job label) into the capacity ledger: a mirror (k8s/cache/mirror.py) of the
pods label-selected `!seqtrain.dev/job` and field-selected not terminated (a pod that ends leaves the selection, and the
watch says DELETED); every relist replaces what the ledger held of them.

Why not kopf: kopf watches a resource with one label selector, and it would keep every foreign pod whole. This used
to be a LIST of every foreign pod on the admission path, every 5 s while any job waited (unpaginated); now admission
reads the ledger and never waits on the API.
"""

from __future__ import annotations

from seqtrain_operator.k8s.api.client import Kube
from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.cache.mirror import Mirror, key_of
from seqtrain_operator.k8s.capacity.ledger import Ledger
from seqtrain_operator.k8s.pods import manifests as m

SELECTOR = f"!{m.LABEL_JOB}"
NOT_TERMINATED = "status.phase!=Succeeded,status.phase!=Failed"


def ForeignPods(kube: Kube, ledger: Ledger) -> Mirror:  # noqa: N802 - was a class; the callers' name is kept
    return Mirror(kube, "pods", label_selector=SELECTOR, field_selector=NOT_TERMINATED, project=project.pod,
                  on_upsert=lambda pod, _old: ledger.update(pod), on_delete=lambda pod: ledger.remove(key_of(pod)),
                  name="other tenants' pods")
