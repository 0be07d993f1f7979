"""The wire between a gateway process and an engine core (engine_process.py, engine_child.py).

    _frame(msg) -> bytes        # a 4-byte big-endian length, then the pickled message
    link = _Link(sock)          # the core's end (and a parent's during a handshake)
    link.send(msg); link.receive(block=True) -> [msg, ...]

Batching: a gateway process sends everything one turn of its event loop produced (adds, aborts,
grammar and control messages) as one frame, ("msgs", [msg, ...]); the core sends one frame per
step per link, ("out", outputs, stats, taken, others), however many requests the step advanced.
`unpack` flattens the first shape so both sides read plain messages.

Threads: a core's loop runs on its main thread, and a constrained request's grammar is compiled on a
thread of its own, which sends its reply itself. So `_Link.send` is serialised by a lock, and reads
never change the socket's blocking mode (a non-blocking read is one recv with MSG_DONTWAIT): a send
from the compile thread can neither interleave with the loop's nor turn the loop's draining read into
one that blocks.
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading

_HEADER = struct.Struct("!I")
_RECV_BYTES = 1 << 20


def _frame(msg: tuple) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def unpack(msgs: list[tuple]) -> list[tuple]:
    """Messages with every ("msgs", [...]) batch opened, in order."""
    if not any(m[0] == "msgs" for m in msgs):
        return msgs
    out: list[tuple] = []
    for m in msgs:
        if m[0] == "msgs":
            out.extend(m[1])
        else:
            out.append(m)
    return out


class _Link:
    """Blocking or draining reads, sends from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)       # once: reads choose per call (MSG_DONTWAIT), sends always block
        self.sock = sock
        self.buf = bytearray()
        self.closed = False
        self._send_lock = threading.Lock()

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: tuple) -> None:
        data = _frame(msg)
        with self._send_lock:
            self.sock.sendall(data)

    def receive(self, block: bool) -> list[tuple]:
        """The whole messages that have arrived (batches opened); when `block`, waits for at least one
        (or the peer's end)."""
        msgs: list[tuple] = []
        while not self.closed:
            try:
                chunk = self.sock.recv(_RECV_BYTES, 0 if block and not msgs else socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self.buf += chunk
            msgs.extend(self._parse())
        return unpack(msgs)

    def _parse(self) -> list[tuple]:
        out, pos = [], 0
        while len(self.buf) - pos >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self.buf, pos)
            end = pos + _HEADER.size + n
            if len(self.buf) < end:
                break
            out.append(pickle.loads(self.buf[pos + _HEADER.size:end]))
            pos = end
        del self.buf[:pos]
        return out
