"""The one SeqTrainJob manifest builder for tests (importable as `jobs`: tests/ is on sys.path under pytest).

A test names only the fields it is about; the API's defaults fill the rest, so a test's job reads as its case:

    SeqTrainJob.model_validate(make_job("gpt", "ml", replicas=2, resources={"gpus": 8}))
"""

from __future__ import annotations

from typing import Any

API_VERSION = "seqtrain.dev/v1alpha1"


def make_job(name: str = "j", namespace: str | None = None, *, metadata: dict[str, Any] | None = None,
             **spec: Any) -> dict[str, Any]:
    """A SeqTrainJob manifest (a plain dict, nothing validated): `spec` holds exactly the keyword fields given,
    `metadata` adds fields (uid, resourceVersion, labels, ...) after the name and namespace."""
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    meta.update(metadata or {})
    return {"apiVersion": API_VERSION, "kind": "SeqTrainJob", "metadata": meta, "spec": spec}
