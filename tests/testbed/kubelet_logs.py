"""The kubelet's log endpoint for the node agent's pods, so `kubectl logs` and `seqtrain logs` work on the testbed.

The API server serves `pods/log` by calling the pod's node at `GET https://<InternalIP>:<kubeletEndpoint port>
/containerLogs/<namespace>/<pod>/<container>?follow=...&tailLines=...` (scripts/testbed.sh prefers InternalIP, as
kubeadm clusters do; without --kubelet-certificate-authority it does not verify the kubelet's certificate). This
server answers that for every node of one agent (they share 127.0.0.1) from the container's log file, as the
kubelet does from the runtime's: `follow` streams until the container's process has exited, and a pod that is gone
or not started is a 404/400 with the kubelet's wording. `previous` is always 400: restartPolicy Never pods have no
previous container.
"""

from __future__ import annotations

import contextlib
import http.server
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHUNK = 64 * 1024
FOLLOW_POLL_S = 0.2


def self_signed(folder: Path) -> tuple[Path, Path]:
    """(cert, key) for 127.0.0.1, made once per agent state folder."""
    cert, key = folder / "kubelet.crt", folder / "kubelet.key"
    if not (cert.exists() and key.exists()):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "30", "-subj", "/CN=testbed-kubelet",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


def tail_offset(path: Path, lines: int) -> int:
    """Byte offset where the last `lines` lines of the file begin."""
    size = path.stat().st_size
    if lines <= 0:
        return size
    with open(path, "rb") as f:
        data = f.read()
    end = len(data) - 1 if data.endswith(b"\n") else len(data)
    at = end
    for _ in range(lines):
        at = data.rfind(b"\n", 0, at)
        if at < 0:
            return 0
    return at + 1


class LogServer:
    """`log_of(namespace, pod, container)` -> (log path, running?) or an (HTTP status, message) error."""

    def __init__(self, log_of: Callable[[str, str, str], tuple[Path, Callable[[], bool]] | tuple[int, str]],
                 state: Path, stop: threading.Event):
        self.log_of, self.stop = log_of, stop
        cert, key = self_signed(state)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # the agent's log stays about pods
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.serve(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(cert), str(key))
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="kubelet-logs", daemon=True).start()

    def serve(self, h: http.server.BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(h.path)
        parts = url.path.strip("/").split("/")
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        if len(parts) != 4 or parts[0] != "containerLogs":
            return self._error(h, 404, f"no handler for {url.path}")
        _, namespace, pod, container = parts
        if query.get("previous") in ("true", "1"):
            return self._error(h, 400, f'previous terminated container "{container}" in pod "{pod}" not found')
        found = self.log_of(namespace, pod, container)
        if isinstance(found[0], int):
            return self._error(h, found[0], str(found[1]))
        path, running = found  # type: ignore[misc]
        follow = query.get("follow") in ("true", "1")
        offset = tail_offset(path, int(query["tailLines"])) if query.get("tailLines", "").lstrip("-").isdigit() else 0
        h.send_response(200)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(offset)
            while True:
                alive = running()  # read before the data: a process that ended has written all it will
                data = f.read(CHUNK)
                if data:
                    h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    h.wfile.flush()
                    continue
                if not follow or not alive or self.stop.is_set():
                    break
                time.sleep(FOLLOW_POLL_S)
            h.wfile.write(b"0\r\n\r\n")
            h.wfile.flush()

    @staticmethod
    def _error(h: http.server.BaseHTTPRequestHandler, code: int, message: str) -> None:
        body = message.encode()
        h.send_response(code)
        h.send_header("Content-Type", "text/plain")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        with contextlib.suppress(OSError):
            h.wfile.write(body)


def container_log(pod_root: Path, container: str, first: str) -> Path:
    """The node agent's log file of `container` in the pod folder (tests/testbed/node_agent.py names them)."""
    return pod_root / ("container.log" if container == first else f"container.{container}.log")
