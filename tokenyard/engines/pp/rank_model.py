"""What one rank of a pipeline (x tensor) parallel engine loads: its stage's layers, its
tensor-parallel slice of them, quantised when the engine asks for it, and their KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenyard.engines.model import kv_cache
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.pp.dist_env import RankLayout
from tokenyard.engines.pp.stage_split import StagePart, stage_layers, trim_to_stage_
from tokenyard.engines.quant.engine_model import load_engine_model
from tokenyard.engines.tp.tensor_parallel import check_divisible


@dataclass(slots=True)
class StageSpec:
    """The engine's settings every rank needs; rank 0 broadcasts it at start-up."""

    tp: int
    pp: int
    model_dir: str
    dtype: str                # a torch dtype name, e.g. "float32"
    device: str               # "cpu" or "cuda"
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_cache_dtype: str
    attention_backend: str
    quantization: str
    quant_group_size: int
    timeout_s: float
    progress: bool = False


def device_for(device_type: str, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if device_type == "cuda" else torch.device("cpu")


def load_rank_model(spec: StageSpec, rank: int, device: torch.device,
                    tp_group: torch.distributed.ProcessGroup | None) -> tuple[CausalLM, ModelConfig, StagePart]:
    """The full model's config and this rank's part of the model (sharded, then cut to its stage)."""
    layout = RankLayout(spec.tp, spec.pp)
    stage, tp_rank = layout.coords(rank)
    mcfg = ModelConfig.from_dir(spec.model_dir)
    part = StagePart(stage, spec.pp, stage_layers(mcfg.num_layers, spec.pp)[stage])
    dtype = getattr(torch, spec.dtype)
    progress = spec.progress and rank == 0
    if spec.tp == 1:
        model, cfg = load_engine_model(spec.model_dir, dtype, device, spec.max_model_len, progress, mcfg,
                                       spec.quantization, spec.quant_group_size)
    else:
        check_divisible(mcfg, spec.tp)
        from tokenyard.engines.quant.tp_shard import load_sharded_model
        model, cfg = load_sharded_model(spec.model_dir, dtype, device, spec.max_model_len, progress, mcfg,
                                        spec.quantization, spec.quant_group_size, tp_rank, spec.tp, tp_group)
    # Every rank loads the whole checkpoint onto its device and then keeps its part (as the
    # tensor-parallel workers do): correct and simple, but start-up needs room for the full model
    # on each rank's device, so a model larger than one device cannot start yet. A loader that
    # reads only the stage's layers (and shards while reading) is the missing piece.
    trim_to_stage_(model, part)
    return model, cfg, part


def allocate_stage_kv(model: CausalLM, cfg: ModelConfig, part: StagePart, spec: StageSpec,
                      device: torch.device) -> list:
    """KV for this rank's layers (its kv heads under tensor parallelism), the engine's block count:
    block ids are rank 0's block manager's on every rank."""
    local = getattr(model, "local_cfg", cfg)
    return kv_cache.allocate_kv_cache(part.kv_config(local), spec.num_blocks, spec.block_size,
                                      getattr(torch, spec.dtype), device, spec.kv_cache_dtype)
