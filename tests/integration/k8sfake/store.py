"""The state of the fake API server: objects, resourceVersions, the event history that watches replay.

Semantics follow the Kubernetes API conventions (api-conventions.md, "Concurrency Control and Consistency",
"Spec and Status", the garbage collector's ownerReference rules), reduced to what a controller can observe:
- every write bumps one cluster-wide resourceVersion; lists report it, watches resume after it, and a watch from a
  version older than the retained history gets 410 Gone;
- create sets uid, creationTimestamp, generation 1; a name already taken is 409 AlreadyExists;
- update/patch carrying metadata.resourceVersion must match the stored one, else 409 Conflict;
- for kinds with a status subresource, writes to the main resource ignore .status and writes to /status change
  only .status; metadata.generation increases only when the spec (anything but metadata/status) changes;
- delete of an object with finalizers only sets deletionTimestamp; removing the last finalizer then deletes it;
- deleting an owner deletes its dependents (ownerReferences.uid), recursively (propagationPolicy Background /
  Foreground; Orphan removes the reference instead).
All methods are synchronous and thread-safe: the HTTP layer and test code call them from different threads.
"""

from __future__ import annotations

import copy
import datetime as dt
import itertools
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .selectors import match_fields, match_labels


class ApiError(Exception):
    """An error the server answers with a Kubernetes Status object."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    status_subresource: bool = False
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)


BUILTIN = [
    Resource("", "v1", "pods", "Pod", status_subresource=True),
    Resource("", "v1", "services", "Service", status_subresource=True),
    Resource("", "v1", "configmaps", "ConfigMap"),
    Resource("", "v1", "secrets", "Secret"),
    Resource("", "v1", "events", "Event"),
    Resource("", "v1", "nodes", "Node", namespaced=False, status_subresource=True),
    Resource("", "v1", "namespaces", "Namespace", namespaced=False, status_subresource=True),
    Resource("events.k8s.io", "v1", "events", "Event"),
    Resource("coordination.k8s.io", "v1", "leases", "Lease"),
    Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, status_subresource=True),
]

Key = tuple[str, str, str, str]  # group, plural, namespace ("" when cluster-scoped), name


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    """RFC 6902 JSON patch (add, remove, replace, test): what clients use to edit list items precisely."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = _pointer(op["path"])
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1] if parts else ""
        kind = op["op"]
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(idx, op["value"])
            elif kind == "remove":
                parent.pop(idx)
            elif kind == "replace":
                parent[idx] = op["value"]
            elif kind == "test" and parent[idx] != op["value"]:
                raise ApiError(422, "Invalid", f"test failed at {op['path']}")
        else:
            if kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise ApiError(422, "Invalid", f"replace of missing path {op['path']}")
                parent[last] = op["value"]
            elif kind == "remove":
                if last not in parent:
                    raise ApiError(422, "Invalid", f"remove of missing path {op['path']}")
                del parent[last]
            elif kind == "test" and parent.get(last) != op["value"]:
                raise ApiError(422, "Invalid", f"test failed at {op['path']}")
    return doc


@dataclass
class WatchEvent:
    rv: int
    resource: tuple[str, str]
    type: str
    object: dict[str, Any]


@dataclass
class Store:
    history_limit: int = 2000
    resources: dict[tuple[str, str], Resource] = field(default_factory=dict)
    objects: dict[Key, dict[str, Any]] = field(default_factory=dict)
    history: deque[WatchEvent] = field(default_factory=deque)
    _rv: itertools.count = field(default_factory=lambda: itertools.count(1))
    rv: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)
    listeners: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        for r in BUILTIN:
            self.resources[r.key] = r

    # ---- resources -------------------------------------------------------------------------------------------

    def resource(self, group: str, plural: str) -> Resource:
        r = self.resources.get((group, plural))
        if r is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({group}/{plural})")
        return r

    def _register_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for v in spec.get("versions", []):
            if v.get("served", True) and v.get("storage", True):
                self.resources[(spec["group"], names["plural"])] = Resource(
                    spec["group"], v["name"], names["plural"], names["kind"],
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    status_subresource="status" in (v.get("subresources") or {}),
                    short_names=tuple(names.get("shortNames", [])), categories=tuple(names.get("categories", [])))

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _bump(self) -> str:
        self.rv = next(self._rv)
        return str(self.rv)

    def _emit(self, r: Resource, type_: str, obj: dict[str, Any]) -> None:
        self.history.append(WatchEvent(int(obj["metadata"]["resourceVersion"]), r.key, type_, copy.deepcopy(obj)))
        while len(self.history) > self.history_limit:
            self.history.popleft()
        for fn in list(self.listeners):
            fn()

    def oldest_rv(self) -> int:
        return self.history[0].rv if self.history else self.rv + 1

    def events_after(self, rv: int, r: Resource) -> list[WatchEvent]:
        with self.lock:
            return [e for e in self.history if e.rv > rv and e.resource == r.key]

    @staticmethod
    def _key(r: Resource, namespace: str | None, name: str) -> Key:
        return (r.group, r.plural, (namespace or "") if r.namespaced else "", name)

    # ---- reads -----------------------------------------------------------------------------------------------

    def get(self, r: Resource, namespace: str | None, name: str) -> dict[str, Any]:
        with self.lock:
            obj = self.objects.get(self._key(r, namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{r.plural}{"." + r.group if r.group else ""} "{name}" not found')
            return copy.deepcopy(obj)

    def list(self, r: Resource, namespace: str | None = None, label_selector: str = "",
             field_selector: str = "") -> tuple[list[dict[str, Any]], str]:
        with self.lock:
            items = [copy.deepcopy(o) for (g, p, ns, _), o in sorted(self.objects.items())
                     if (g, p) == r.key and (not namespace or ns == namespace)
                     and match_labels(label_selector, o) and match_fields(field_selector, o)]
            return items, str(self.rv)

    # ---- writes ----------------------------------------------------------------------------------------------

    def create(self, r: Resource, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            if r.namespaced:
                if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                    raise ApiError(400, "BadRequest", "the namespace of the object does not match the request")
                meta["namespace"] = namespace or meta.get("namespace") or "default"
            else:
                meta.pop("namespace", None)
            if not meta.get("name"):
                if meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                else:
                    raise ApiError(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            key = self._key(r, meta.get("namespace"), meta["name"])
            if key in self.objects:
                raise ApiError(409, "AlreadyExists", f'{r.plural} "{meta["name"]}" already exists')
            obj["apiVersion"], obj["kind"] = r.api_version, r.kind
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
            meta.pop("deletionTimestamp", None)
            if r.status_subresource:
                obj["status"] = {"phase": "Pending"} if r.key == ("", "pods") else {}
            meta["resourceVersion"] = self._bump()
            self.objects[key] = obj
            if r.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
                self._register_crd(obj)
            self._emit(r, "ADDED", obj)
            return copy.deepcopy(obj)

    def _write(self, r: Resource, namespace: str | None, name: str, new: dict[str, Any], *,
               subresource: str | None, expected_rv: str | None) -> dict[str, Any]:
        key = self._key(r, namespace, name)
        old = self.objects.get(key)
        if old is None:
            raise ApiError(404, "NotFound", f'{r.plural} "{name}" not found')
        if expected_rv and expected_rv != old["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {r.plural} "{name}": the object has '
                                            "been modified; please apply your changes to the latest version and try again")
        if subresource == "status":
            obj = copy.deepcopy(old)
            obj["status"] = new.get("status", {})
        else:
            obj = copy.deepcopy(new)
            if r.status_subresource:
                obj["status"] = copy.deepcopy(old.get("status", {}))
            meta = obj.setdefault("metadata", {})
            # immutable and server-owned metadata
            for k in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp", "generation"):
                if k in old["metadata"]:
                    meta[k] = old["metadata"][k]
                else:
                    meta.pop(k, None)
            strip = ("metadata", "status") if r.status_subresource else ("metadata",)
            if {k: v for k, v in obj.items() if k not in strip} != {k: v for k, v in old.items() if k not in strip}:
                meta["generation"] = old["metadata"].get("generation", 1) + 1
        obj["apiVersion"], obj["kind"] = r.api_version, r.kind
        if obj == old:
            return copy.deepcopy(old)  # a no-op write does not bump the resourceVersion
        obj["metadata"]["resourceVersion"] = self._bump()
        if obj["metadata"].get("deletionTimestamp") and not obj["metadata"].get("finalizers"):
            del self.objects[key]
            self._emit(r, "DELETED", obj)
            self._collect_dependents(obj["metadata"]["uid"], "Background")
            return copy.deepcopy(obj)
        self.objects[key] = obj
        self._emit(r, "MODIFIED", obj)
        return copy.deepcopy(obj)

    def replace(self, r: Resource, namespace: str | None, name: str, body: dict[str, Any],
                subresource: str | None = None) -> dict[str, Any]:
        with self.lock:
            rv = (body.get("metadata") or {}).get("resourceVersion")
            if not rv:
                raise ApiError(422, "Invalid", "metadata.resourceVersion: Invalid value: 0x0: must be specified for an update")
            return self._write(r, namespace, name, body, subresource=subresource, expected_rv=rv)

    def patch(self, r: Resource, namespace: str | None, name: str, patch: Any, content_type: str,
              subresource: str | None = None) -> dict[str, Any]:
        with self.lock:
            old = self.get(r, namespace, name)
            if "json-patch" in content_type:
                if not isinstance(patch, list):
                    raise ApiError(400, "BadRequest", "a JSON patch must be a list of operations")
                new, rv = json_patch(old, patch), None
            else:
                if not isinstance(patch, dict):
                    raise ApiError(400, "BadRequest", "a merge patch must be an object")
                # A resourceVersion inside a merge patch is an optimistic-lock precondition.
                rv = (patch.get("metadata") or {}).get("resourceVersion")
                new = merge_patch(old, patch)
            return self._write(r, namespace, name, new, subresource=subresource, expected_rv=rv)

    def delete(self, r: Resource, namespace: str | None, name: str, options: dict[str, Any] | None = None
               ) -> dict[str, Any]:
        options = options or {}
        with self.lock:
            key = self._key(r, namespace, name)
            obj = self.objects.get(key)
            if obj is None:
                raise ApiError(404, "NotFound", f'{r.plural} "{name}" not found')
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != obj["metadata"]["uid"]:
                raise ApiError(409, "Conflict", f"Precondition failed: UID in precondition: {pre['uid']}, "
                                                f"UID in object meta: {obj['metadata']['uid']}")
            if pre.get("resourceVersion") and pre["resourceVersion"] != obj["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", "Precondition failed: resourceVersion")
            if obj["metadata"].get("finalizers"):
                if not obj["metadata"].get("deletionTimestamp"):
                    obj = copy.deepcopy(obj)
                    obj["metadata"]["deletionTimestamp"] = _now()
                    obj["metadata"]["resourceVersion"] = self._bump()
                    self.objects[key] = obj
                    self._emit(r, "MODIFIED", obj)
                return copy.deepcopy(obj)
            del self.objects[key]
            gone = copy.deepcopy(obj)
            gone["metadata"]["resourceVersion"] = self._bump()
            self._emit(r, "DELETED", gone)
            self._collect_dependents(obj["metadata"]["uid"], options.get("propagationPolicy") or "Background")
            return gone

    def delete_collection(self, r: Resource, namespace: str | None, label_selector: str = "",
                          field_selector: str = "") -> list[dict[str, Any]]:
        with self.lock:
            items, _ = self.list(r, namespace, label_selector, field_selector)
            return [self.delete(r, i["metadata"].get("namespace"), i["metadata"]["name"]) for i in items]

    def _collect_dependents(self, uid: str, policy: str) -> None:
        """The garbage collector: dependents of a deleted owner go too (or lose the reference with Orphan)."""
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if not any(ref.get("uid") == uid for ref in refs):
                continue
            r = self.resources[(key[0], key[1])]
            if policy == "Orphan":
                self.patch(r, key[2] or None, key[3],
                           {"metadata": {"ownerReferences": [x for x in refs if x.get("uid") != uid] or None}},
                           "application/merge-patch+json")
            elif key in self.objects:
                self.delete(r, key[2] or None, key[3], {"propagationPolicy": "Background"})


def names(items: Iterable[dict[str, Any]]) -> list[str]:
    return [i["metadata"]["name"] for i in items]
