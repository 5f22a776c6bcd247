"""Polling rank 0's progress endpoint (`GET http://<pod IP>:<progressPort>/progress`, served by
`seqtrain.obs.progress`). Optional: without a port, or when the pod does not answer within the timeout, the
operator goes on without progress (the termination message still gives the final one). The body is read up to
MAX_BODY_BYTES only (the pod is the user's, and a progress document is a few hundred bytes) and checked by the
one progress reader (seqtrain.spec.progress_doc) that the push endpoint and the local backend use too."""

from __future__ import annotations

import asyncio

import aiohttp

from seqtrain.spec.progress_doc import MAX_DOC_BYTES
from seqtrain_operator.k8s.pods.observe import Reported, progress_from_json

MAX_BODY_BYTES = MAX_DOC_BYTES


def authority(host: str, port: int | str) -> str:
    """`host:port` for a URL; an IPv6 address goes in brackets (RFC 3986), else its colons read as a port."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def progress_url(ip: str, port: int) -> str:
    return f"http://{authority(ip, port)}/progress"


async def poll_progress(ip: str, port: int, timeout: float = 2.0) -> Reported:
    url = progress_url(ip, port)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                session.get(url) as resp:
            if resp.status != 200:
                return Reported()
            body = await read_capped(resp.content, MAX_BODY_BYTES + 1)
            if len(body) > MAX_BODY_BYTES:
                return Reported()  # not a progress document: nothing more is read
            return progress_from_json(body)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return Reported()


async def read_capped(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The body up to its end or `limit` bytes, whichever comes first: one `read(n)` returns only what is
    buffered, so a body that arrives in several TCP segments would otherwise be cut short."""
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = await stream.read(limit - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
