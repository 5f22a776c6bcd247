"""The progress push's names and tokens (k8s/push.py), apart from its server so the manifest builders can use them
without importing it: a job's push URL, and its token HMAC-SHA256(operator key, "<namespace>/<job>/<uid>")."""

from __future__ import annotations

import hashlib
import hmac

from seqtrain.obs.push import TOKEN_ENV, URL_ENV  # the trainer's side (torch-free)

__all__ = ["KEY_ENV", "PUSH_PATH", "TOKEN_ENV", "URL_ENV", "job_token", "push_url", "valid_token"]
PUSH_PATH = "/v1/progress"
KEY_ENV = "SEQTRAIN_PROGRESS_PUSH_KEY"  # the operator's secret key (the chart keeps it in a Secret)


def job_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    return hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).hexdigest()


def valid_token(key: bytes, namespace: str, name: str, uid: str, token: str) -> bool:
    """Constant-time comparison; never true without a key."""
    return bool(key) and hmac.compare_digest(token.encode(), job_token(key, namespace, name, uid).encode())


def push_url(base: str, namespace: str, name: str, uid: str) -> str:
    """Where the job's rank 0 pushes: `base` is the operator's push endpoint as pods reach it."""
    return f"{base.rstrip('/')}{PUSH_PATH}/{namespace}/{name}/{uid}"
