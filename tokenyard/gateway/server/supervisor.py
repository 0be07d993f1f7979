"""`tokenyard serve` with `server.workers` > 1: engine cores first, then N gateway workers on one socket.

    supervise(deployment)      # blocks until SIGTERM / Ctrl-C has drained the workers

The split (as vLLM V1 makes it): each built-in engine without replicas steps in one engine core
process (tokenyard/engines/serving/engine_core.py, engine_child.py), which accepts any number of links
on a Unix socket; each worker process (tokenyard/gateway/server/worker.py) runs the whole gateway (HTTP,
auth, limits, routing, spend) on the listening socket this process bound and passed down (the kernel
hands each connection to one worker), and links to every core. Several workers share the HTTP, JSON
and SSE work that one event loop does alone; the engine stays one engine, with one KV cache and one
batch.

What stays exact across workers: rate limits, budgets and spend are in Redis already. The admission
queue is one per worker, but each worker counts the whole engine: the core sends every link, after
every step, the engine's stats and the number of requests the other links hold in it
(EngineProcess.others_in_flight), and a worker's admission sees an engine as full when its own running
requests plus the others' reach the slots (tokenyard/gateway/admission/engine_queues.py). Why not one
queue in the core: the queue's order needs tenants, weights and deadlines, which are the gateway's; the
core would become a second gateway. The cost of this design: two workers may each see the last free slot
in the same step, so the engine can take up to workers - 1 more than its slots for one step (its own
scheduler then holds them waiting); and the per-tenant concurrency cap counts per worker (as it counts
per gateway when several gateways share Redis).

Failures: a worker that exits is started again (after 0.5 s doubling to 30 s while it keeps dying
within 10 s of its start); a core that exits is started again here, and each worker's link to it is
made again (EngineProcess with `connect`: requests with no token yet are sent to the fresh core, the
ones streaming end with an error). SIGTERM (or Ctrl-C) drains: the workers get SIGTERM and drain as a
single gateway does (server.drain_grace_s), then the cores stop; a second signal makes the workers exit
at once. Workers run in a session of their own, so a terminal's Ctrl-C reaches them only through here.
A worker that stops reading its link (stopped, wedged) never stalls a core: the core's sends to it do not
block, and after server.worker_stall_s without taking a frame its link is dropped (its requests aborted);
the worker, when it runs again, links again (tokenyard/engines/serving/link_outbox.py).
"""
from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tokenyard.gateway.config.deployment import Deployment
from tokenyard.gateway.server.connection_guard import BACKLOG

log = logging.getLogger("tokenyard.server")

_QUICK_EXIT_S = 10.0          # a child that dies sooner than this after its start backs off before the next
_MAX_BACKOFF_S = 30.0
_ROOT = Path(__file__).resolve().parents[3]


@dataclass
class _Child:
    """A worker or a core, and when to start it again."""

    name: str
    proc: subprocess.Popen | None = None
    started: float = 0.0
    failures: int = 0             # quick exits in a row
    next_start: float = 0.0


def core_engines(dep: Deployment) -> list[str]:
    """The engines that get a shared core: every built-in one without replicas (module docstring)."""
    return [n for n, s in dep.engines.items() if s.upstream is None and s.replicas is None]


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    def __init__(self, dep: Deployment, run_dir: Path) -> None:
        from tokenyard.gateway.backends.engine_pool import _recipe
        self.dep = dep
        self.run_dir = run_dir
        self.recipes = {n: _recipe(dep.engines[n]) for n in core_engines(dep)}
        self.sockets = {n: run_dir / f"core-{i}.sock" for i, n in enumerate(self.recipes)}
        self.cores = {n: _Child(n) for n in self.recipes}
        self.workers = [_Child(f"worker-{i}") for i in range(dep.workers)]
        self.listener: socket.socket | None = None
        self.signals = 0

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> None:
        for name, child in self.cores.items():      # blocking: each core builds its engine
            self._start_core(child)
        worker_dep = replace(self.dep, engine_sockets=dict(self.sockets))
        (self.run_dir / "deployment.pickle").write_bytes(pickle.dumps(worker_dep))
        self.listener = _listen(self.dep.host, self.dep.port)
        for i, child in enumerate(self.workers):
            self._start_worker(i, child)

    def _start_core(self, child: _Child) -> None:
        from tokenyard.engines.serving.engine_core import start_listening_core
        child.proc = start_listening_core(self.recipes[child.name], child.name, self.sockets[child.name],
                                          self.dep.worker_stall_s)
        child.started = time.monotonic()

    def _start_worker(self, index: int, child: _Child) -> None:
        assert self.listener is not None
        fd = self.listener.fileno()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenyard.gateway.server.worker", "--fd", str(fd), "--index", str(index),
             "--deployment", str(self.run_dir / "deployment.pickle")],
            pass_fds=(fd,), env=env, start_new_session=True)
        child.started = time.monotonic()

    # -- watch ----------------------------------------------------------------------------------
    def watch(self) -> None:
        """Start again what exits, until a signal asks to stop."""
        while not self.signals:
            now = time.monotonic()
            for child in self.cores.values():
                if self._gone(child, now) and now >= child.next_start:
                    try:
                        self._start_core(child)
                        log.warning("engine core %s started again", child.name)
                    except Exception as e:  # noqa: BLE001 - retried with backoff; workers wait for it
                        log.error("engine core %s did not start: %s", child.name, e)
                        self._backoff(child, now)
            for i, child in enumerate(self.workers):
                if self._gone(child, now) and now >= child.next_start and not self.signals:
                    self._start_worker(i, child)
                    log.warning("gateway %s started again", child.name)
            time.sleep(0.1)

    def _gone(self, child: _Child, now: float) -> bool:
        """True when the child is not running; counts a fresh exit and sets its backoff."""
        if child.proc is None:
            return True
        code = child.proc.poll()
        if code is None:
            return False
        log.error("%s (pid %d) exited with %s; starting it again", child.name, child.proc.pid, code)
        child.proc = None
        self._backoff(child, now)
        return True

    @staticmethod
    def _backoff(child: _Child, now: float) -> None:
        child.failures = child.failures + 1 if now - child.started < _QUICK_EXIT_S else 0
        child.next_start = now + (min(_MAX_BACKOFF_S, 0.5 * 2 ** (child.failures - 1)) if child.failures else 0.0)

    # -- stop -----------------------------------------------------------------------------------
    def on_signal(self, signum: int, frame) -> None:
        self.signals += 1
        for child in self.workers:     # the first drains, a second cuts (DrainingServer.handle_exit)
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        deadline = time.monotonic() + self.dep.drain_grace_s + 10
        for child in self.workers:
            if child.proc is None:
                continue
            if child.proc.poll() is None and not self.signals:
                child.proc.send_signal(signal.SIGTERM)
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if self.listener is not None:
            self.listener.close()
        for child in self.cores.values():
            if child.proc is not None and child.proc.poll() is None:
                child.proc.terminate()
        for child in self.cores.values():
            if child.proc is not None:
                try:
                    child.proc.wait(10)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()


def supervise(dep: Deployment, announce, dev_key: str | None) -> int:
    """Run cores and workers until a signal; 0 after a clean drain. `dep.redis_url` is already set."""
    run_dir = Path(tempfile.mkdtemp(prefix="tokenyard-serve-"))
    dep.auth.dev_key = dev_key or dep.auth.dev_key    # the workers know the key the supervisor made
    sup = Supervisor(dep, run_dir)
    previous = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        sup.start()
        announce(f"tokenyard: {dep.workers} gateway workers serving {', '.join(dep.engines)} at "
                 f"http://{dep.host}:{dep.port}/v1 (engine cores: {', '.join(sup.cores) or 'none'})")
        sup.watch()
        return 0
    finally:
        sup.stop()
        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(run_dir, ignore_errors=True)
