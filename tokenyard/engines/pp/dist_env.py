"""How the ranks of a pipeline (x tensor) parallel engine find each other and which groups they join.

Ranks: world = tensor_parallel_size * pipeline_parallel_size, rank = stage * tp + tp_rank, so
rank 0 (the engine: it schedules and samples) is stage 0's first tensor-parallel rank.

Two ways to meet:
- the standard torch.distributed environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), as set
  by torchrun or a Kubernetes job: rank 0 is the engine process, ranks 1.. run
  `python -m tokenyard.engines.pp.stage_worker` on any node that reaches MASTER_ADDR; they meet in a store
  rank 0 keeps on MASTER_PORT, one numbered generation per engine it builds (engine_store);
- otherwise the engine spawns its workers locally (as tensor parallelism does) over loopback, on
  a fresh port per engine.

Groups, created in the same order on every rank:
- the default group: gloo, for start-up messages (the engine's spec, readiness);
- `ctrl`: gloo with a very long timeout, for step headers and inputs: a worker waits on it
  between requests, which may be hours apart (a dead peer still fails it at once: sockets close);
- `data`: the activations and logits (gloo on CPU, nccl on CUDA), with the engine's tp_timeout_s;
- one tensor-parallel group per stage (the data backend).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch.distributed as dist

ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
IDLE_TIMEOUT = timedelta(days=365)   # ctrl group: a worker may wait this long for the next step
GENERATION_KEY = "tokenyard/engine_generation"
READY = "ready"   # a rank's start-up status when it loaded its part
_rank0_stores: dict[tuple[str, int], dist.TCPStore] = {}   # rank 0's store per (MASTER_ADDR, MASTER_PORT)


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


# With the torch.distributed environment, every engine rank 0 builds (the gateway rebuilds one
# after a failure, in the same process) is a new "generation": rank 0 keeps one store on
# MASTER_PORT for its whole life, counts generations in it, and each generation meets under its
# own key prefix. A worker that served generation g waits for g + 1, so it can never meet a
# closed engine's leftovers on the reused port.

def engine_store(env: DistEnv, timeout_s: float) -> tuple[dist.Store, int]:
    """Rank 0: the store the next engine's ranks meet in, and its generation number."""
    key = (env.master_addr, env.master_port)
    store = _rank0_stores.get(key)
    if store is None:
        # Under torchrun its agent already serves MASTER_PORT: join that store as a client.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = _rank0_stores[key] = dist.TCPStore(env.master_addr, env.master_port, is_master=not agent,
                                                   wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    gen = store.add(GENERATION_KEY, 1)
    return dist.PrefixStore(f"tokenyard/{gen}/", store), gen


def worker_store(env: DistEnv, after: int, timeout_s: float) -> tuple[dist.Store, int]:
    """A worker: the store of the first engine generation above `after` (0: the current one,
    or the first to come), waiting for rank 0 as long as it takes."""
    client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    while True:
        gen = client.add(GENERATION_KEY, 0)
        if gen > after:
            return dist.PrefixStore(f"tokenyard/{gen}/", client), gen
        time.sleep(0.2)


def join(meet: str | dist.Store, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """Join the default (gloo) group through an init method (tcp://...) or a store, then the
    ctrl group; returns ctrl."""
    if dist.is_initialized():
        raise RuntimeError("a distributed (tensor- or pipeline-parallel) engine is already running in this process; "
                           "close it (llm.close(), a `with LLM(...)` block, or engine.close()) before starting another")
    where = dict(init_method=meet) if isinstance(meet, str) else dict(store=meet)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **where)
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
