"""Rank 0 of a tensor-parallel engine: starts the workers, sends each step's inputs, fails fast.

The engine process is rank 0: it schedules, runs its own slice of the forward and samples.
Before each forward it sends the step's StepInputs (plain lists) to every worker over a pipe;
all ranks then run the same layers and meet in the all-reduces.

Failure: a worker that dies makes rank 0's next collective fail (the peer's socket closes) or,
at worst, time out after `tp_timeout_s`; a liveness check before each step catches a worker
that died between steps. Either way the runner raises EngineDeadError, the engine fails every
in-flight request with that message, and the owner can start a new engine: nothing hangs.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import time

import torch
import torch.distributed as dist

from tokenyard.engines.core.errors import EngineDeadError
from tokenyard.engines.model.model_runner import ModelRunner, StepInputs
from tokenyard.engines.tp.tp_worker import WorkerSpec, init_group, worker_main

DEATH_GRACE_S = 2.0   # how long a failed collective waits for a dead worker to be reaped

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Ranks 1..N-1 as spawned processes, plus rank 0's membership of the process group."""

    def __init__(self, world: int, make_spec, timeout_s: float) -> None:
        if dist.is_initialized():
            raise EngineDeadError("a tensor-parallel engine is already running in this process; "
                                  "close it (llm.close(), a `with LLM(...)` block, or engine.close()) before starting another")
        self.world = world
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")  # fork would copy rank 0's threads and torch state
        init = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[mp.Process] = []
        self.conns = []
        for rank in range(1, world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(make_spec(rank, init), child), daemon=True,
                               name=f"tokenyard-tp{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.closed = False
        try:
            init_group(make_spec(0, init))
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise EngineDeadError(f"tensor-parallel worker {rank} exited during start-up "
                                          f"(exit code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise EngineDeadError(f"tensor-parallel worker {rank} not ready after {self.timeout_s:.0f} s")
            kind, detail = conn.recv()
            if kind != "ready":
                raise EngineDeadError(f"tensor-parallel worker {rank} failed to start:\n{detail}")

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise EngineDeadError(f"tensor-parallel worker {rank} died (exit code {proc.exitcode})")

    def send(self, inputs: StepInputs) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(inputs)
            except OSError as exc:
                raise EngineDeadError(f"tensor-parallel worker {rank} is unreachable: {exc}") from exc

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse a clean exit
                log.warning("tensor-parallel process group did not shut down cleanly", exc_info=True)


class TensorParallelRunner(ModelRunner):
    """A ModelRunner whose every forward is mirrored on the workers."""

    def __init__(self, group: WorkerGroup, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        self.group.check_alive()
        self.group.send(inputs)
        try:
            return super().forward(inputs)
        except RuntimeError as exc:  # gloo/nccl: a peer closed its socket or the timeout passed
            # The peer's socket can close before its process is reaped: give the dead worker a
            # moment to show as dead, so the error names it rather than the broken collective.
            deadline = time.monotonic() + DEATH_GRACE_S
            while True:
                try:
                    self.group.check_alive()
                except EngineDeadError as dead:
                    raise dead from exc
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
            raise EngineDeadError(f"tensor-parallel collective failed: {exc}") from exc

    def close(self) -> None:
        self.group.close()


def start(world: int, spec_args: dict, timeout_s: float) -> WorkerGroup:
    """spec_args: WorkerSpec fields other than rank and init_method."""
    return WorkerGroup(world, lambda rank, init: WorkerSpec(rank=rank, init_method=init, **spec_args), timeout_s)
