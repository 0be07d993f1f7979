"""The LoRA adapters a gateway process loaded or unloaded at run time, replayed on a fresh engine core.

    changes = AdapterChanges()
    changes.record("load", "sql", "/srv/adapters/sql")        # after the core said yes (engine_process.py)
    hello = changes.replay(sock, hello, recipe, "w2")         # a fresh core, before any request reaches it

Why: a core builds its engine from its recipe, whose lora_modules are the deployment's adapters. One
loaded through the admin API (tokenyard/gateway/routes/adapter_admin.py) lives only in the core that
loaded it, so a core killed and started again (EngineProcess's restart, or the supervisor's with
server.workers > 1) would refuse requests for it while the gateway still routes them there; and an
unloaded deployment adapter would come back. The parent keeps the net change per adapter name (its
latest successful load path, or None for unloaded) and, once the fresh core has said hello and before
the parent's event loop owns the socket, sends them in the order they were first made and waits for
each answer.

Rules: a load whose name the fresh core already serves is skipped (another gateway worker replayed
it, or the deployment has it from the same folder), unless the deployment maps that name to another
folder (the run-time load had replaced it: unloaded first, then loaded). An unload of a name the core
does not serve is skipped. A replay the core refuses is logged; a load refused for its folder
(invalid, e.g. deleted since) is forgotten, so the next restart does not try it again. A link that
fails during the replay raises OSError / ConnectionError: the caller's restart backoff tries again.

The replay reads the link frame by frame (exactly a header, then exactly its body), never ahead: what
the core sends after the last answer (frames of other workers' steps) stays in the socket for the
event loop's reader. Such frames arriving before an answer carry no outputs of this link's (it has
sent no request yet) and are skipped.
"""
from __future__ import annotations

import logging
import pickle
import socket
from typing import Any

from tokenyard.engines.serving.engine_link import _HEADER, _frame

log = logging.getLogger("tokenyard.engines.serving.engine_process")

REPLAY_TIMEOUT_S = 120.0      # per answer: a core reads the adapter from disk between two steps


class AdapterChanges:
    """Net run-time change per adapter name: its folder (loaded) or None (unloaded), in first-change order."""

    def __init__(self) -> None:
        self.changes: dict[str, str | None] = {}

    def __bool__(self) -> bool:
        return bool(self.changes)

    def record(self, op: str, name: str, path: str | None) -> None:
        self.changes[name] = str(path) if op == "load" else None

    def replay(self, sock: socket.socket, hello: tuple, recipe: Any, engine: str) -> tuple:
        """Apply the changes on the core behind `sock` (blocking); the hello with the latest stats."""
        stats = hello[2]
        configured = dict((getattr(recipe, "options", {}) or {}).get("lora_modules") or {})
        previous = sock.gettimeout()
        sock.settimeout(REPLAY_TIMEOUT_S)
        try:
            for name, path in list(self.changes.items()):
                have = name in (getattr(stats, "lora_names", None) or ())
                ops: list[tuple[str, str | None]] = []
                if path is None:
                    ops = [("unload", None)] if have else []
                elif not have:
                    ops = [("load", path)]
                elif configured.get(name) not in (None, path):
                    ops = [("unload", None), ("load", path)]
                for op, arg in ops:
                    _, err, new_stats = _ask(sock, ("adapter", op, name, arg))
                    if new_stats is not None:
                        stats = new_stats
                    if err is None:
                        log.info("engine %s: LoRA adapter %s %sed again on the fresh core", engine, name, op)
                        continue
                    log.warning("engine %s: replaying the %s of LoRA adapter %s on the fresh core was refused "
                                "(%s: %s)", engine, op, name, *err)
                    if op == "load" and err[0] == "invalid":
                        self.changes.pop(name, None)
                    break
        finally:
            sock.settimeout(previous)
        return (*hello[:2], stats, *hello[3:])


def _ask(sock: socket.socket, msg: tuple) -> tuple:
    """Send one control message; its ("adapter", result, error, stats) answer, minus the kind."""
    sock.sendall(_frame(msg))
    while True:
        (n,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
        reply = pickle.loads(_read_exactly(sock, n))
        if reply[0] == "adapter":
            return reply[1:]
        if reply[0] == "failed":
            raise ConnectionError(f"the engine core failed while LoRA adapters were replayed: {reply[1]}")
        # ("out", [], stats, 0, others): another worker's step, nothing of ours yet


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the engine core hung up while LoRA adapters were replayed")
        buf += chunk
    return bytes(buf)
