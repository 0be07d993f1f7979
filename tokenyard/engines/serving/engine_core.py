"""Starting an engine core: a fresh interpreter that builds an engine from its recipe and steps it.

    proc, sock, hello = spawn_core(recipe, "w2")                 # one gateway process on a socketpair
    proc = start_listening_core(recipe, "w2", Path("w2.sock"))   # several, each connecting to the path
    sock, hello = connect_core(Path("w2.sock"))                  # a gateway worker's link to it

`hello` is the core's ("ready", max_model_len, stats, grammar_info, embedding_size, startup_phases). Building fails loudly: the
recipe's own exception (a bad option) is raised here, in the caller, as it would be in-process.
The loop the core runs is tokenyard/engines/serving/engine_child.py; the parent's side,
tokenyard/engines/serving/engine_process.py.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.serving.engine_link import _Link

_ROOT = Path(__file__).resolve().parents[3]    # holds tokenyard/: the child imports it from here
_STOP_GRACE_S = 10.0


@dataclass(frozen=True, slots=True)
class EngineRecipe:
    """What an engine is built from, picklable so a fresh process can build it."""

    kind: str                                   # "torch" or "mock"
    model: Path                                 # checkpoint folder or .gguf file (mock: its tokenizer)
    options: dict[str, Any] = field(default_factory=dict)   # EngineConfig / MockConfig keys

    def engine_class(self) -> type:
        """The class build() makes, imported (torch's import, for a torch engine: a core times it apart)."""
        if self.kind == "mock":
            from tokenyard.engines.serving.mock_engine import MockEngine
            return MockEngine
        from tokenyard.engines.runtime.engine import Engine
        return Engine

    def build(self) -> Any:
        cls = self.engine_class()
        if self.kind == "mock":
            return cls(self.model, **self.options)
        return cls(self.model, **{"progress": False, **self.options})


def _popen(name: str, fd: int, listen: Path | None, stall_s: float | None = None) -> subprocess.Popen:
    # A fresh interpreter, not fork (the parent has an event loop and torch's threads, which fork
    # would copy half-alive) and not multiprocessing's spawn (which imports the parent's __main__).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "tokenyard.engines.serving.engine_core", "--fd", str(fd), "--name", name]
    if listen is not None:
        argv += ["--listen", str(listen)]
    if stall_s is not None:
        argv += ["--stall-s", repr(float(stall_s))]
    return subprocess.Popen(argv, pass_fds=(fd,), env=env)


def _handshake(link: _Link, proc: subprocess.Popen, name: str, recipe: EngineRecipe) -> tuple:
    link.send(("recipe", recipe))
    msgs = link.receive(block=True)
    if not msgs or msgs[0][0] != "ready":
        link.sock.close()
        reap(proc)
        if msgs and msgs[0][0] == "failed":
            _, message, exc = msgs[0]
            if exc is not None:
                raise exc
            raise EngineDeadError(f"engine {name}: {message}")
        raise EngineDeadError(f"engine {name}: its process exited while building the engine "
                              f"(exit code {proc.returncode})")
    if len(msgs) > 1 or link.buf:
        raise EngineDeadError(f"engine {name}: unexpected messages after ready")
    return msgs[0]


def spawn_core(recipe: EngineRecipe, name: str) -> tuple[subprocess.Popen, socket.socket, tuple]:
    """Start a core for one parent and wait until its engine is built (blocking: weights load there)."""
    ours, theirs = socket.socketpair()
    try:
        proc = _popen(name, theirs.fileno(), None)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours, _handshake(_Link(ours), proc, name, recipe)


def start_listening_core(recipe: EngineRecipe, name: str, path: Path, stall_s: float | None = None) -> subprocess.Popen:
    """Start a core that serves every link connected to the Unix socket `path` (gateway workers), and
    wait until its engine is built. The socket is bound before the engine builds, so a worker may
    connect early (it waits for the core's hello). `stall_s`: how long a worker may leave the core's
    frames unread before its link is dropped (server.worker_stall_s; tokenyard/engines/serving/link_outbox.py)."""
    ours, theirs = socket.socketpair()
    try:
        proc = _popen(name, theirs.fileno(), path, stall_s)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        _handshake(_Link(ours), proc, name, recipe)
    finally:
        ours.close()
    return proc


def connect_core(path: Path, timeout_s: float = 600.0) -> tuple[socket.socket, tuple]:
    """A link to a listening core and its hello (blocking; ConnectionError when it is not there)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        link = _Link(sock)
        msgs = link.receive(block=True)
    except BaseException:
        sock.close()
        raise
    if not msgs or msgs[0][0] != "ready":
        sock.close()
        raise ConnectionError(f"engine core at {path} hung up before saying it was ready")
    return sock, msgs[0]


def reap(proc: subprocess.Popen | None) -> None:
    """Wait for a process told to exit (its socket closed); terminate, then kill, one that does not."""
    if proc is None:
        return
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            proc.wait(_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def main() -> None:
    from tokenyard.engines.serving.engine_child import _child_main
    from tokenyard.engines.serving.link_outbox import DEFAULT_STALL_S
    ap = argparse.ArgumentParser(description="an engine core; started by EngineProcess or the gateway's "
                                             "supervisor, not by hand")
    ap.add_argument("--fd", type=int, required=True, help="the inherited end of the parent's socketpair")
    ap.add_argument("--name", default="engine")
    ap.add_argument("--listen", help="serve every link connected to this Unix socket path")
    ap.add_argument("--stall-s", type=float, default=None,
                    help="with --listen: drop a link that took none of the core's frames for this long")
    args = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the parent decides
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s engine-process[{args.name}]: %(message)s")
    listener = None
    if args.listen:
        try:        # a core shared by gateway workers ends with the supervisor that started it (Linux prctl)
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
        path = Path(args.listen)
        path.unlink(missing_ok=True)               # a previous core's, which died
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(64)
    stall_s = DEFAULT_STALL_S if args.stall_s is None else args.stall_s
    _child_main(socket.socket(fileno=args.fd), listener, stall_s, own_process=True)


if __name__ == "__main__":
    main()
