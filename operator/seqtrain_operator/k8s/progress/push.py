"""Progress pushed by rank 0 to the operator (`POST <url>/v1/progress/<namespace>/<job>/<job uid>/<attempt>`), for
clusters where the operator cannot reach the pods (a default-deny NetworkPolicy, an mTLS mesh, an operator outside
the cluster): the trainer opens the connection, so only egress from the pod to the operator's Service is needed.

Authentication (k8s/pods/pushauth.py): the token is HMAC-SHA256(operator key, "<namespace>/<job>/<uid>/<attempt>"),
mounted into the pods as a file from a per-attempt Secret the job owns; the operator recomputes it from the URL and
compares in constant time. So a pod can push only for its own job incarnation and attempt. Beyond the signature the
store refuses what it knows to be over: the token of a deleted job, of an earlier incarnation of the same name
(another uid) and of an attempt earlier than the one the last pass saw. Entries are kept by uid, so no push for
one incarnation can replace another's.

Each push carries a sequence number (header `Seqtrain-Push-Sequence`, growing with every push of the attempt): a
document whose number is not above the last stored one of its attempt is ignored (409), so a replayed or late
document neither refreshes the entry nor sets progress back, and can never pass for a fresh push of an old step
(which a pass reads as a hang). The body is read up to MAX_BODY_BYTES (as a polled one) and parsed by the same
parser.

What was pushed is kept in memory (`PushedProgress`, the Reconciler's, by job uid) with the time it arrived; a pass uses
it while it is fresh (rank 0 repeats its document every few seconds even when no step completed, so a fresh but
unchanged document is a hang, not a lost channel) and polls otherwise. Only the active operator's pushes count:
with several replicas a push reaches one of them (one connection per push, so the Service spreads them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType

from seqtrain.spec.progress_doc import ProgressError, parse_progress
from seqtrain_operator.k8s.pods.observe import Reported
from seqtrain_operator.k8s.pods.pushauth import PUSH_PATH, SEQUENCE_HEADER, valid_token
from seqtrain_operator.k8s.progress.poll import MAX_BODY_BYTES

log = logging.getLogger("seqtrain.operator")

MAX_GONE = 4096  # uids of deleted jobs remembered, to refuse their tokens with a reason
MAX_SEQUENCE = 2**63 - 1


@dataclass(frozen=True)
class Pushed:
    namespace: str
    name: str
    attempt: int
    sequence: int
    reported: Reported
    received: float  # time.monotonic() when it arrived


@dataclass
class PushedProgress:
    """The last accepted push per job incarnation (by uid), what the passes last saw of each job, and counts of what
    was refused (by HTTP status)."""

    jobs: dict[str, Pushed] = field(default_factory=dict)  # by job uid
    live: dict[tuple[str, str], tuple[str, int | None]] = field(default_factory=dict)  # (ns, job) -> (uid, attempt)
    gone: OrderedDict[str, None] = field(default_factory=OrderedDict)  # uids of deleted jobs, oldest first
    refused: Counter[int] = field(default_factory=Counter)
    accepted: int = 0

    def accept(self, key: bytes, namespace: str, name: str, uid: str, attempt: int, authorization: str | None,
               sequence: str | None, body: bytes, now: float | None = None) -> tuple[int, str]:
        """(HTTP status, reason) of one push, checked against the operator's `key`; 204 when it was stored."""
        status, reason = self._check(key, namespace, name, uid, attempt, authorization, sequence, body, now)
        if status == 204:
            self.accepted += 1
        else:
            self.refused[status] += 1
        return status, reason

    def _check(self, key: bytes, namespace: str, name: str, uid: str, attempt: int, authorization: str | None,
               sequence: str | None, body: bytes, now: float | None) -> tuple[int, str]:
        if not key:
            return 404, "progress push is off"
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not valid_token(key, namespace, name, uid, attempt, token.strip()):
            return 403, "the token is not this job's and attempt's"
        live_uid, live_attempt = self.live.get((namespace, name), (uid, None))
        if uid in self.gone or live_uid != uid:
            self._bury(uid)  # a pass named another uid for this name: this incarnation is over
            return 403, "the token of a deleted job"
        if live_attempt is not None and attempt < live_attempt:
            return 403, f"the token of attempt {attempt}; the job is at attempt {live_attempt}"
        if len(body) > MAX_BODY_BYTES:
            return 413, f"a progress document is at most {MAX_BODY_BYTES} bytes"
        seq = _sequence(sequence)
        if seq is None:
            return 400, f"no {SEQUENCE_HEADER} header (an integer from 1 to 2^63-1)"
        try:  # the one reader: bounded size and depth checked on the raw bytes before any parsing
            reported = parse_progress(body)
        except ProgressError as exc:
            return 400, f"not a progress document: {exc}"
        if reported.progress is None:
            return 400, "not a progress document"
        if reported.progress.attempt is not None and reported.progress.attempt != attempt:
            return 400, f"a document of attempt {reported.progress.attempt} with the token of attempt {attempt}"
        last = self.jobs.get(uid)
        if last is not None and (attempt, seq) <= (last.attempt, last.sequence):
            return 409, f"sequence {seq} is not above {last.sequence}: an older or replayed document, ignored"
        self.jobs[uid] = Pushed(namespace, name, attempt, seq, reported, time.monotonic() if now is None else now)
        return 204, ""

    def fresh(self, namespace: str, name: str, uid: str, max_age: float, attempt: int | None = None,
              now: float | None = None) -> Reported | None:
        """The job's pushed progress if it arrived within `max_age` seconds, from this job (uid) and, when given,
        from `attempt` (a dying gang's rank 0 may still push). A pass calls this with what it read of the job: from
        then on pushes of another uid under this name, or of an earlier attempt, are refused."""
        known_uid, known_attempt = self.live.get((namespace, name), (uid, None))
        if known_uid != uid:  # the name was deleted and re-created: its old incarnation is gone
            self._bury(known_uid)
        self.live[(namespace, name)] = (uid, attempt if attempt is not None else known_attempt)
        p = self.jobs.get(uid)
        if p is None or (time.monotonic() if now is None else now) - p.received > max_age:
            return None
        if attempt is not None and p.attempt != attempt:
            return None
        return p.reported

    def forget(self, uid: str) -> None:
        """The job incarnation `uid` was deleted: its entry goes and its tokens are refused from now on. A namesake
        created since (another uid) keeps its entry and its name."""
        for key in [k for k, (live_uid, _) in self.live.items() if live_uid == uid]:
            del self.live[key]
        self._bury(uid)

    def _bury(self, uid: str) -> None:
        self.jobs.pop(uid, None)
        self.gone[uid] = None
        self.gone.move_to_end(uid)
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)


def _sequence(value: str | None) -> int | None:
    text = (value or "").strip()
    if not text.isdigit() or len(text) > 19:
        return None
    n = int(text)
    return n if 1 <= n <= MAX_SEQUENCE else None


# The server's limits (module constants so a test can shrink them): connections served at once, seconds from
# accept to the last byte of the reply, bytes of request line and headers, and when, at the cap, a connection
# whose request has not arrived may be closed for a newcomer (a valid push arrives in milliseconds).
MAX_CONNECTIONS = 64
DEADLINE_S = 10.0
EVICT_AFTER_S = 1.0
MAX_HEAD_BYTES = 8192
LOG_EVERY_S = 60.0  # at most one summary line of what was refused per this many seconds

_REASONS = MappingProxyType({
    204: "No Content", 400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
    408: "Request Timeout", 409: "Conflict", 411: "Length Required", 413: "Content Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"})


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(eq=False)
class _Conn:
    writer: asyncio.StreamWriter
    accepted: float  # time.monotonic()
    requested: bool = False  # the whole request arrived: never closed for a newcomer


class PushServer:
    """The push endpoint on asyncio streams, in the operator's event loop, with every limit in one place: at most
    `MAX_CONNECTIONS` at once (at the cap a newcomer replaces the oldest connection still waiting for its request
    after `EVICT_AFTER_S`, or gets 503), `DEADLINE_S` for the whole exchange (request line, headers, body, reply:
    not per read, so a byte a second does not keep a connection), `MAX_HEAD_BYTES` of head (431), a body of at most
    `MAX_BODY_BYTES` read whole as its Content-Length declares however it is split over TCP writes (413 beyond),
    one request per connection. Bad requests get 4xx; what was refused is logged as one summary line a minute."""

    def __init__(self, store: PushedProgress, key: bytes) -> None:
        self.store, self.key = store, key
        self.max_connections, self.deadline, self.evict_after = MAX_CONNECTIONS, DEADLINE_S, EVICT_AFTER_S
        self._open: set[_Conn] = set()
        self._tasks: set[asyncio.Task] = set()  # every connection's, until it has closed its socket
        self._server: asyncio.AbstractServer | None = None
        self.cut = 0  # connections closed at their deadline or for a newcomer
        self._unlogged: Counter[int] = Counter()
        self._logged_at = float("-inf")

    async def start(self, addr: str, port: int) -> None:
        self._server = await asyncio.start_server(self._connection, addr, port, limit=MAX_HEAD_BYTES)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def cleanup(self) -> None:
        """Stop accepting and close every open connection (the name aiohttp's AppRunner has)."""
        if self._server is not None:
            self._server.close()
            for conn in list(self._open):
                conn.writer.transport.abort()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=5.0)
            await self._server.wait_closed()
            self._server = None

    def _admit(self, conn: _Conn) -> bool:
        if len(self._open) >= self.max_connections:
            stale = [c for c in self._open if not c.requested and conn.accepted - c.accepted >= self.evict_after]
            if not stale:
                return False
            victim = min(stale, key=lambda c: c.accepted)
            self._open.discard(victim)
            victim.writer.transport.abort()  # its task sees the connection reset and ends
            self.cut += 1
        self._open.add(conn)
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(writer, time.monotonic())
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            if not self._admit(conn):
                status, reason = 503, "too many connections"
            else:
                try:
                    status, reason = await asyncio.wait_for(self._exchange(reader, conn), self.deadline)
                except asyncio.TimeoutError:
                    self.cut += 1
                    status, reason = 408, f"the request did not arrive within {self.deadline:g}s"
                except _Refused as exc:
                    status, reason = exc.status, exc.reason
                except (ConnectionError, asyncio.IncompleteReadError):
                    return  # hung up, or closed for a newcomer: nobody to answer
            if status != 204:
                self._note(status)
            await asyncio.wait_for(self._reply(writer, status, reason), 2.0)
        except (ConnectionError, asyncio.TimeoutError, OSError):
            pass
        finally:
            self._open.discard(conn)
            await _close(writer)
            self._tasks.discard(task)  # type: ignore[arg-type]

    async def _exchange(self, reader: asyncio.StreamReader, conn: _Conn) -> tuple[int, str]:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise _Refused(431, f"request line and headers are at most {MAX_HEAD_BYTES} bytes") from None
        method, path, headers = _parse_head(head)
        if method != "POST":
            raise _Refused(405, "POST only")
        parts = path.split("?", 1)[0].split("/")
        prefix = PUSH_PATH.strip("/").split("/")
        if (len(parts) != len(prefix) + 5 or parts[1:len(prefix) + 1] != prefix or not all(parts[len(prefix) + 1:])
                or not parts[-1].isdigit() or len(parts[-1]) > 9):
            raise _Refused(404, f"POST {PUSH_PATH}/<namespace>/<job>/<uid>/<attempt>")
        namespace, name, uid, attempt = parts[len(prefix) + 1:]
        if "transfer-encoding" in headers:
            raise _Refused(411, "a Content-Length body only")
        declared = headers.get("content-length", "")
        if not declared:
            raise _Refused(411, "a Content-Length body only")
        if not (declared.isascii() and declared.isdigit()) or len(declared) > 12:  # int() would take "+1_0"
            raise _Refused(400, "Content-Length is not a number of bytes")
        length = int(declared)
        if length > MAX_BODY_BYTES:
            raise _Refused(413, f"a progress document is at most {MAX_BODY_BYTES} bytes")
        body = await reader.readexactly(length)  # however many TCP writes it came in
        conn.requested = True
        return self.store.accept(self.key, namespace, name, uid, int(attempt), headers.get("authorization"),
                                 headers.get(SEQUENCE_HEADER.lower()), body)

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, reason: str) -> None:
        text = b"" if status == 204 else (reason + "\n").encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
                     f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode() + text)
        await writer.drain()

    def _note(self, status: int) -> None:
        """Count a refusal; log the counts at most once per LOG_EVERY_S (one line, not one per connection)."""
        self._unlogged[status] += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            counts = ", ".join(f"{n} x {s}" for s, n in sorted(self._unlogged.items()))
            log.info("progress push: refused %s (since the last such line; at most one a minute)", counts)
            self._unlogged.clear()
            self._logged_at = now


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after the reply is flushed (a few dozen bytes: the socket takes them at once), or abort within 1 s."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (asyncio.TimeoutError, OSError):
        writer.transport.abort()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path, headers with lower-case names) of an HTTP/1.x request head; 400 when it is not one."""
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, path, version = lines[0].split(" ")
        if not version.startswith("HTTP/1.") or not path.startswith("/"):
            raise ValueError(lines[0])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ValueError(line)
            if name.lower() in headers and name.lower() in ("content-length", "authorization",
                                                            SEQUENCE_HEADER.lower()):
                raise ValueError(f"{name} twice")
            headers[name.lower()] = value.strip()
    except ValueError:
        raise _Refused(400, "not an HTTP/1.x request") from None
    return method, path, headers


async def serve(store: PushedProgress, key: bytes, port: int, addr: str = "0.0.0.0") -> PushServer:
    """Serve the push endpoint in the running event loop (kopf's); `await server.cleanup()` stops it."""
    server = PushServer(store, key)
    await server.start(addr, port)
    return server
