"""Polling rank 0's progress endpoint (`GET http://<pod IP>:<progressPort>/progress`, served by
`seqtrain.obs.progress`). Optional: without a port, or when the pod does not answer within the timeout, the
operator goes on without progress (the termination message still gives the final one)."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from seqtrain_operator.k8s.observe import Reported, progress_from_json


async def poll_progress(ip: str, port: int, timeout: float = 2.0) -> Reported:
    url = f"http://{ip}:{port}/progress"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session, \
                session.get(url) as resp:
            if resp.status != 200:
                return Reported()
            return progress_from_json(json.loads(await resp.text()))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError):
        return Reported()
