"""Whose object is it (pure): the SeqTrainJob (`Owner`) an object of the operator belongs to, by uid and labels.

Why: a job deleted and re-applied under the same name at once is another job with the same object names (pods
`<job>-1-<r>`, ConfigMap `<job>-config-1`). Its predecessor's pods may still be terminating and its immutable
ConfigMap waiting for the garbage collector; keyed by name alone, the new job adopted both (and counted the dying
pods as a failure of its own). Every object the operator creates carries the job's uid in a label (and its
ownerReference), and every reader checks it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from seqtrain.spec import API_GROUP, API_VERSION, KIND

LABEL_UID = f"{API_GROUP}/job-uid"
# The labels every pod of a job carries, and `Owner` below: here, not in the pod builder (pods/manifests.py), so the
# gang adapters, which the builder imports, can name them without importing it.
LABEL_JOB = f"{API_GROUP}/job"
LABEL_ATTEMPT = f"{API_GROUP}/attempt"
LABEL_REPLICA = f"{API_GROUP}/replica"


@dataclass(frozen=True)
class Owner:
    """The SeqTrainJob the objects belong to (name, namespace, uid as read from the cluster)."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def owner_uid(obj: Mapping[str, Any]) -> str | None:
    """The job-uid label, else the SeqTrainJob controller ownerReference's uid (an older operator's object); None
    when the object names neither (an older operator's KAI pod: no ownerReference)."""
    meta = obj.get("metadata") or {}
    if uid := (meta.get("labels") or {}).get(LABEL_UID):
        return uid
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("controller"):
            return ref.get("uid")
    return None


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether `obj` belongs to the job with this uid (one that names no owner is taken as the job's)."""
    return owner_uid(obj) in (uid, None)
