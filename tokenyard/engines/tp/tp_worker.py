"""A tensor-parallel worker process (ranks 1..N-1).

It loads the same checkpoint, keeps its slice (tokenyard.engines.tp.tensor_parallel), allocates its share of
the KV cache (its kv heads, the same block count as rank 0) and then runs one forward per
StepInputs message from rank 0, taking part in the all-reduces and the logits all-gather. It
never schedules or samples: rank 0 owns all request state, so a worker holds nothing that a
restart would lose.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    world: int
    init_method: str
    backend: str              # "gloo" (CPU) or "nccl" (CUDA)
    model_dir: str
    dtype: str                # a torch dtype name, e.g. "float32"
    device: str               # "cpu" or "cuda"
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_cache_dtype: str       # "auto", "int8" or "fp8_e4m3" (each rank stores its own kv heads so)
    attention_backend: str
    timeout_s: float


def device_for(device_type: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def init_group(spec: WorkerSpec) -> None:
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world,
                            timeout=timedelta(seconds=spec.timeout_s))


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    # Imported here: the spawned interpreter only pays for what the worker uses.
    from tokenyard.engines.model.kv_cache import allocate_kv_cache
    from tokenyard.engines.model.model_runner import ModelRunner
    from tokenyard.engines.model.runner_config import RunnerConfig
    from tokenyard.engines.tp.tensor_parallel import shard_model_
    from tokenyard.engines.weights.checkpoint import load_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    try:
        device = device_for(spec.device, spec.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init_group(spec)
        dtype = getattr(torch, spec.dtype)
        model, _ = load_model(spec.model_dir, dtype, device, spec.max_model_len, progress=False)
        shard_model_(model, spec.rank, spec.world)
        kv = allocate_kv_cache(model.local_cfg, spec.num_blocks, spec.block_size, dtype, device, spec.kv_cache_dtype)
        runner = ModelRunner(model, kv, device, RunnerConfig(spec.block_size, spec.attention_backend))
        conn.send(("ready", None))
        while True:
            inputs = conn.recv()
            if inputs is None:
                break
            runner.forward(inputs)
    except (EOFError, KeyboardInterrupt):
        pass  # rank 0 went away: nothing to report to
    except BaseException:  # noqa: BLE001 - report anything, then exit non-zero
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
