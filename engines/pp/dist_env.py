"""How the ranks of a pipeline (x tensor) parallel engine find each other and which groups they join.

Ranks: world = tensor_parallel_size * pipeline_parallel_size, rank = stage * tp + tp_rank, so
rank 0 (the engine: it schedules and samples) is stage 0's first tensor-parallel rank.

Two ways to meet:
- the standard torch.distributed environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), as set
  by torchrun or a Kubernetes job: rank 0 is the engine process, ranks 1.. run
  `python -m engines.pp.stage_worker` on any node that reaches MASTER_ADDR;
- otherwise the engine spawns its workers locally (as tensor parallelism does) over loopback.

Groups, created in the same order on every rank:
- the default group: gloo, for start-up messages (the engine's spec, readiness);
- `ctrl`: gloo with a very long timeout, for step headers and inputs: a worker waits on it
  between requests, which may be hours apart (a dead peer still fails it at once: sockets close);
- `data`: the activations and logits (gloo on CPU, nccl on CUDA), with the engine's tp_timeout_s;
- one tensor-parallel group per stage (the data backend).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
IDLE_TIMEOUT = timedelta(days=365)   # ctrl group: a worker may wait this long for the next step


@dataclass(frozen=True, slots=True)
class RankLayout:
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, tp_rank) of a rank."""
        return divmod(rank, self.tp)

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, j) for j in range(self.tp)]

    def source(self, rank: int) -> int | None:
        """Where a rank receives each step from: the same tensor-parallel rank of the previous
        stage (it sends inputs and hidden states), or rank 0 for stage 0 (inputs only)."""
        stage, j = self.coords(rank)
        if stage > 0:
            return self.rank(stage - 1, j)
        return 0 if j > 0 else None

    def successor(self, rank: int) -> int | None:
        stage, j = self.coords(rank)
        return self.rank(stage + 1, j) if stage < self.pp - 1 else None

    @property
    def logits_rank(self) -> int:
        """The last stage's first rank: it sends each step's logits back to rank 0."""
        return self.rank(self.pp - 1, 0)


@dataclass(frozen=True, slots=True)
class DistEnv:
    """The torch.distributed environment variables, when a launcher set them."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int

    @property
    def init_method(self) -> str:
        """"env://": torch reads the same variables (and under torchrun uses its agent's store
        rather than binding MASTER_PORT a second time)."""
        return "env://"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistEnv | None":
        """None when none of ENV_VARS is set; a ValueError naming the problem when only some are
        set or a value is not valid."""
        env = os.environ if environ is None else environ
        present = [k for k in ENV_VARS if env.get(k)]
        if not present:
            return None
        missing = [k for k in ENV_VARS if k not in present]
        if missing:
            raise ValueError(f"torch.distributed environment is incomplete: {', '.join(present)} set but "
                             f"{', '.join(missing)} missing")
        try:
            port, world, rank = int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), int(env["RANK"])
        except ValueError as exc:
            raise ValueError(f"MASTER_PORT, WORLD_SIZE and RANK must be integers: {exc}") from exc
        if not 0 < port < 65536 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"invalid torch.distributed environment: MASTER_PORT={port} WORLD_SIZE={world} "
                             f"RANK={rank}")
        return cls(env["MASTER_ADDR"], port, world, rank)


@dataclass(slots=True)
class StageGroups:
    ctrl: dist.ProcessGroup
    data: dist.ProcessGroup | None        # None: the default group (gloo on CPU)
    tp: dist.ProcessGroup | None          # this rank's stage's tensor-parallel group (None when tp == 1)


def join(init_method: str, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """Join the default (gloo) group, then the ctrl group; returns ctrl."""
    if dist.is_initialized():
        raise RuntimeError("a distributed (tensor- or pipeline-parallel) engine is already running in this process; "
                           "close it (engine.close()) before starting another")
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def stage_groups(ctrl: dist.ProcessGroup, layout: RankLayout, rank: int, device_type: str,
                 timeout_s: float) -> StageGroups:
    """The data and tensor-parallel groups (every rank must call this, in the same order)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    data = dist.new_group(backend=backend, timeout=timeout) if backend != "gloo" else None
    mine = None
    for stage in range(layout.pp if layout.tp > 1 else 0):
        g = dist.new_group(layout.stage_ranks(stage), backend=backend, timeout=timeout)
        if layout.coords(rank)[0] == stage:
            mine = g
    return StageGroups(ctrl, data, mine)
