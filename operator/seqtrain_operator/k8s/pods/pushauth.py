"""The progress push's names and credentials (k8s/progress/push.py), apart from its server so the manifest builders can
use them without importing it.

A push is bound to one job incarnation and one attempt: its URL names `<namespace>/<job>/<uid>/<attempt>` and its
token is HMAC-SHA256(operator key, that same string). Rank 0 reads the token from a file mounted from a Secret the
operator creates per attempt (`secret_name`, owned by the job, so deleted with it); the token is never in the pod
spec or its env, where anyone with `get pods` would read it. The operator recomputes the token from the URL: a
token of another job, another incarnation of the same name (another uid) or another attempt does not match, and
nothing but the key has to be kept."""

from __future__ import annotations

import hashlib
import hmac

from seqtrain.obs.push import SEQUENCE_HEADER, TOKEN_FILE_ENV, URL_ENV  # the trainer's side (torch-free)

__all__ = ["KEY_ENV", "PUSH_PATH", "SEQUENCE_HEADER", "TOKEN_DIR", "TOKEN_FILE", "TOKEN_FILE_ENV", "TOKEN_KEY", "URL_ENV",
           "job_token", "push_url", "secret_name", "valid_token"]
PUSH_PATH = "/v1/progress"
KEY_ENV = "SEQTRAIN_PROGRESS_PUSH_KEY"  # the operator's secret key (the chart keeps it in a Secret)
TOKEN_KEY = "token"  # the Secret's key, and the file's name in the mount
TOKEN_DIR = "/var/run/seqtrain/push"  # where the trainer container mounts the Secret (read-only)
TOKEN_FILE = f"{TOKEN_DIR}/{TOKEN_KEY}"


def _subject(namespace: str, name: str, uid: str, attempt: int) -> str:
    return f"{namespace}/{name}/{uid}/{attempt}"


def job_token(key: bytes, namespace: str, name: str, uid: str, attempt: int) -> str:
    return hmac.new(key, _subject(namespace, name, uid, attempt).encode(), hashlib.sha256).hexdigest()


def valid_token(key: bytes, namespace: str, name: str, uid: str, attempt: int, token: str) -> bool:
    """Constant-time comparison; never true without a key."""
    return bool(key) and hmac.compare_digest(token.encode(), job_token(key, namespace, name, uid, attempt).encode())


def push_url(base: str, namespace: str, name: str, uid: str, attempt: int) -> str:
    """Where the job's rank 0 pushes in `attempt`: `base` is the operator's push endpoint as pods reach it."""
    return f"{base.rstrip('/')}{PUSH_PATH}/{_subject(namespace, name, uid, attempt)}"


def secret_name(name: str, uid: str, attempt: int) -> str:
    """The attempt's token Secret: named by the job's uid too, so a deleted namesake's Secret (until the garbage
    collector removes it) is never taken for this job's. At most 50 + 6 + 8 + 1 + 7 characters of a DNS subdomain."""
    return f"{name}-push-{uid.replace('-', '')[:8]}-{attempt}"
