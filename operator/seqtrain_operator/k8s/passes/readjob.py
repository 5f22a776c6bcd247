"""Where a pass reads its job from: kopf's live body, what our last status write returned, or a GET, whichever is
newest as far as the job's memory (k8s/cache/memory.py) can tell. A stale read is caught by the optimistic lock of the
status write, as with a GET; what is saved is a GET after nearly every status write."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from seqtrain_operator.controller import parse
from seqtrain_operator.k8s.api.client import Kube
from seqtrain_operator.k8s.api.finalizers import FINALIZER
from seqtrain_operator.k8s.cache import project
from seqtrain_operator.k8s.cache.memory import JobMemory

# kopf writes no change-detection annotation (handlers.NoDiffBase): its only first write to a new job is the
# finalizer. A kopf that did not write it would only make a new job wait this long for its first pass.
KOPF_SETTLE_SECONDS = 10.0


async def read_job(kube: Kube, mem: JobMemory, live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The job as of the newest version this operator knows, without a GET where it can tell:
    - the live body the first time (nothing newer is known), and when its resourceVersion is the one this operator
      last read or wrote;
    - what our last status write returned while the watch still shows the version that write replaced;
    - the live body when it carries the status we last wrote (only metadata moved on since: kopf's finalizer and
      annotation patches).
    Otherwise (someone else changed the job, or our last write conflicted) a GET."""
    rv = ((live or {}).get("metadata") or {}).get("resourceVersion")
    written = mem.written
    if live is not None and rv is not None and mem.known is None:  # first sight: nothing newer is known
        return project.job(live)
    if rv is not None and rv == mem.known:
        mem.written = None
        return project.job(live)  # type: ignore[arg-type]
    if written is not None and rv is not None:
        if rv == written[0]:  # the watch has not shown our write yet
            return project.job(written[1])
        if live is not None and live.get("status") == written[1].get("status") and \
                (live.get("metadata") or {}).get("generation") == written[1]["metadata"].get("generation"):
            mem.known, mem.written = rv, None
            return project.job(live)
    mem.written = None
    body = await kube.get_job(mem.namespace, mem.name)
    body = project.job(body) if body is not None else None
    mem.known = body["metadata"]["resourceVersion"] if body is not None else None
    return body


def kopf_settling(body: dict[str, Any], now: datetime) -> bool | None:
    """Whether kopf has yet to make its first write to a new job (its finalizer): True, wait for it; False, it is
    late (KOPF_SETTLE_SECONDS): read the job, the watch may be behind; None: done."""
    meta = body["metadata"]
    if body.get("status") or FINALIZER in (meta.get("finalizers") or ()):
        return None
    created = parse(meta.get("creationTimestamp"))
    return created is None or (now - created).total_seconds() < KOPF_SETTLE_SECONDS
