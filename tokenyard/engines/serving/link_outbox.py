"""What an engine core has to send one gateway worker and could not yet: sends that never block the core.

    box = Outbox(sock, stall_s=30.0)
    if not box.send(_frame(msg)): drop the link       # closed, or over MAX_OUTBOX_BYTES
    box.flush()                                       # when the socket is writable again
    if box.stalled(time.monotonic()): drop the link   # nothing written for stall_s while data waits

Why: with server.workers > 1 one core serves every worker (engine_child.py). A blocking send to a worker
that stopped reading (stopped with SIGSTOP, stuck in a long pause, wedged) fills the socket's buffer and
then waits, and the core stops stepping for every worker. Here a send writes what the socket takes at
once (MSG_DONTWAIT: the socket stays blocking for the core's other uses) and keeps the rest, in order;
the core's loop writes it when the selector says the socket is writable. A link whose waiting bytes
pass MAX_OUTBOX_BYTES, or that took no byte for `stall_s` while bytes waited, is given up: the core
drops it like a link that closed (its requests are aborted and their KV blocks freed), and the worker,
when it runs again, sees its link closed and links again (EngineProcess with `connect`).

Threads: the core's loop and a grammar compile thread both send, so the buffer is under a lock.
"""
from __future__ import annotations

import socket
import threading
import time

MAX_OUTBOX_BYTES = 64 << 20     # about 13 s of frames for 256 streaming requests at 100 steps/s
DEFAULT_STALL_S = 30.0          # server.worker_stall_s


class Outbox:
    def __init__(self, sock: socket.socket, stall_s: float = DEFAULT_STALL_S, max_bytes: int = MAX_OUTBOX_BYTES) -> None:
        self.sock = sock
        self.stall_s = stall_s
        self.max_bytes = max_bytes
        self.buf = bytearray()
        self.since = 0.0              # monotonic time of the last byte written while bytes wait
        self.failed: str | None = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return len(self.buf)

    def send(self, data: bytes) -> bool:
        """Queue `data` and write what the socket takes now; False when the link is to be dropped."""
        with self._lock:
            if self.failed is not None:
                return False
            if not self.buf:
                self.since = time.monotonic()
            self.buf += data
            self._write()
            if self.failed is None and len(self.buf) > self.max_bytes:
                self.failed = (f"{len(self.buf)} bytes waited for it (more than {self.max_bytes}): it stopped "
                               "reading")
            return self.failed is None

    def flush(self) -> bool:
        """Write what the socket takes now (the selector said writable); False when the link failed."""
        with self._lock:
            if self.buf and self.failed is None:
                self._write()
            return self.failed is None

    def stalled(self, now: float) -> bool:
        """True (and failed set) when bytes waited `stall_s` without one being written."""
        with self._lock:
            if self.failed is None and self.buf and now - self.since > self.stall_s:
                self.failed = (f"it took nothing for {self.stall_s:g} s (server.worker_stall_s) while "
                               f"{len(self.buf)} bytes waited: it stopped reading")
            return self.failed is not None

    def _write(self) -> None:
        while self.buf:
            try:
                n = self.sock.send(self.buf, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.failed = f"its link failed ({type(e).__name__}: {e})"
                return
            if n <= 0:
                return
            del self.buf[:n]
            self.since = time.monotonic()
