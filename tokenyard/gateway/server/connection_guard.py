"""What a client connection may cost: deadlines on the request head and body, a cap on open
connections, 431 for an oversized head, and a quiet accept-error log.

uvicorn (h11) closes an idle keep-alive connection after a response, but a connection that sends
part of a request line or headers and then nothing is kept forever, and so is one that stops half
way through its body. Each holds a file descriptor; a few thousand such sockets exhaust the
process and nobody is served. `guarded_protocol(settings)` returns uvicorn's H11Protocol with:

* head deadline: from the moment a connection waits for a request head (on connect, and again
  after each response) it has `header_timeout_s` to complete it; then it is closed, with 408 if
  it had started sending one;
* body deadline: a request whose body is not complete `body_timeout_s` after its head is cut,
  with 408 if no response has started (the endpoint sees a disconnect);
* a cap of `max_connections` open connections per process: the connection over the cap closes the
  one that has waited longest for a request head (idle or slow: a connection busy with a request
  is never taken), or, when every connection is busy, is itself refused with 503 and Retry-After.
  The closing waits one turn of the event loop: asyncio accepts a whole burst of sockets before it
  reads any of them, so a client that connected and sent its request at once would otherwise look
  idle, and be taken, when a flood of newer connections lands in the same burst;
* a head over `max_header_bytes` gets 431 (h11 alone answers 400 and closes with the rest of the
  head unread, which the client sees as a connection reset): the answer is written, the write
  side shut, and what the client still sends is read and dropped for a moment, so it reads 431.

Who touches what: everything here runs on the event loop thread (protocol callbacks and timers).
"""
from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("tokenyard.connections")
LINGER_S = 2.0          # after a 431, how long the rest of an oversized head is read and dropped
FD_RESERVE = 256        # file descriptors kept for Redis, engines, logs and files beyond client connections
BACKLOG = 2048          # uvicorn's listen backlog; asyncio also accepts up to this many sockets in one go
                        # before their protocols run, so that many fds can be open beyond the cap
_ACCEPT_ERROR = "socket.accept() out of system resource"


def _raw_response(status: int, reason: str, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable", "param": None, "code": code}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close"]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


REFUSED = _raw_response(503, "Service Unavailable", "too_many_connections",
                        "The gateway holds as many connections as it allows; retry shortly", retry_after=1)
HEAD_TIMEOUT = _raw_response(408, "Request Timeout", "request_timeout", "The request head did not arrive in time")
BODY_TIMEOUT = _raw_response(408, "Request Timeout", "request_timeout", "The request body did not arrive in time")
HEAD_TOO_LARGE = _raw_response(431, "Request Header Fields Too Large", "headers_too_large",
                               "The request line and headers are larger than this gateway accepts")


@dataclass(slots=True)
class ConnectionStats:
    """One server's connection bookkeeping (shared by its protocol instances)."""

    open: int = 0                       # connections counted against max_connections
    waiting: dict[Any, float] = field(default_factory=dict, repr=False)   # waiting for a head, oldest first
    refused: int = 0
    evicted: int = 0
    head_timeouts: int = 0
    body_timeouts: int = 0
    too_large: int = 0
    sweep_pending: bool = False         # a trim back to the cap is scheduled for the next loop turn


def guarded_protocol(settings: Any) -> type[H11Protocol]:
    """H11Protocol bound to `settings` (deployment.Connections) and a fresh ConnectionStats."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"settings": settings, "stats": ConnectionStats()})


class GuardedH11Protocol(H11Protocol):
    settings: Any = None
    stats: ConnectionStats = ConnectionStats()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._counted = True
        self._lingering = False
        self._got_head_bytes = False
        stats = self.stats
        stats.open += 1
        over = stats.open - self.settings.max_connections
        if over > 0:
            if not stats.waiting:
                stats.refused += 1
                self._drop(REFUSED)
                return
            if over > BACKLOG:
                self._evict(over - BACKLOG)   # the fd bound holds even if the loop never turns
            if not stats.sweep_pending:
                # call_later(0) runs after the next select has read the sockets that are ready, so
                # the connections of this burst that already sent a head are busy by then, not idle.
                stats.sweep_pending = True
                self.loop.call_later(0, self._sweep)
        self._wait_head()

    def _sweep(self) -> None:
        self.stats.sweep_pending = False
        self._evict(self.stats.open - self.settings.max_connections)

    def _evict(self, count: int) -> None:
        """Close up to `count` connections, those that have waited longest for a head first."""
        stats = self.stats
        while count > 0 and stats.waiting:
            victim = next(iter(stats.waiting))
            victim._drop(None)
            stats.evicted += 1
            count -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._uncount()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return                          # the rest of an oversized head: read and dropped
        if self in self.stats.waiting:
            self._got_head_bytes = True
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before and not self.transport.is_closing():
            self._head_done()

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()
        return super().eof_received()

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if self.cycle is before:
            self._wait_head()               # keep-alive: the next head has its own deadline
        else:
            self._head_done()               # a pipelined request was already waiting

    def send_400_response(self, msg: str) -> None:
        # h11 refuses a head longer than h11_max_incomplete_event_size (set to max_header_bytes)
        # with a generic protocol error; tell that case apart by the size of what it holds.
        if len(self.conn.trailing_data[0]) > self.settings.max_header_bytes:
            self.stats.too_large += 1
            self._cancel_timer()
            self.stats.waiting.pop(self, None)
            self.transport.write(HEAD_TOO_LARGE)
            self._lingering = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)
            return
        super().send_400_response(msg)

    # --- states -------------------------------------------------------------------------------------
    def _wait_head(self) -> None:
        stats = self.stats
        stats.waiting.pop(self, None)
        stats.waiting[self] = time.monotonic()
        self._got_head_bytes = False
        self._set_timer(self.settings.header_timeout_s, self._head_deadline)

    def _head_done(self) -> None:
        self.stats.waiting.pop(self, None)
        cycle = self.cycle
        if cycle is not None and cycle.more_body:
            self._set_timer(self.settings.body_timeout_s, lambda: self._body_deadline(cycle))
        else:
            self._cancel_timer()

    def _head_deadline(self) -> None:
        self._timer = None
        if self in self.stats.waiting:
            self.stats.head_timeouts += self._got_head_bytes
            self._drop(HEAD_TIMEOUT if self._got_head_bytes else None)

    def _body_deadline(self, cycle: Any) -> None:
        self._timer = None
        if cycle is self.cycle and cycle.more_body and not cycle.response_complete:
            self.stats.body_timeouts += 1
            self._drop(None if cycle.response_started else BODY_TIMEOUT)

    # --- helpers ------------------------------------------------------------------------------------
    def _drop(self, answer: bytes | None) -> None:
        self._uncount()
        self._cancel_timer()
        if not self.transport.is_closing():
            if answer is not None:
                self.transport.write(answer)
            self.transport.close()

    def _uncount(self) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self.stats.open -= 1
            self.stats.waiting.pop(self, None)
        self._cancel_timer()

    def _set_timer(self, delay: float, fn: Any) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, fn)

    def _cancel_timer(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None


def raise_fd_limit() -> tuple[int, int]:
    """Soft limit on open files up to the hard limit (every connection is a file descriptor); returns
    (soft, hard) as they are afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft, hard


def fit_max_connections(max_connections: int, fd_soft_limit: int, backlog: int = BACKLOG) -> int:
    """max_connections, lowered when the open-file limit cannot hold it plus one accept burst
    (backlog) plus FD_RESERVE: running out of fds makes asyncio stop accepting for a second."""
    room = max(16, fd_soft_limit - FD_RESERVE - backlog)
    if max_connections > room:
        log.warning("server.max_connections %d is more than the open-file limit %d allows; using %d",
                    max_connections, fd_soft_limit, room)
        return room
    return max_connections


class QuietAcceptErrors:
    """A loop exception handler that logs "accept() out of system resource" at most once per
    `every_s` with a count (asyncio logs it on every failed accept: millions of lines when file
    descriptors run out); everything else goes to the default handler."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.suppressed = 0
        self.total = 0
        self._last = float("-inf")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith(_ACCEPT_ERROR):
            loop.default_exception_handler(context)
            return
        self.total += 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        log.error("%s (%s); %d more since the last report. Raise the open-file limit or lower "
                  "server.max_connections", _ACCEPT_ERROR, context.get("exception"), self.suppressed)
        self._last = now
        self.suppressed = 0
