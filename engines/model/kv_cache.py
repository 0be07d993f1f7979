"""KV cache tensors: one K and one V tensor per layer, addressed by slot."""
from __future__ import annotations

import torch

from engines.model.model_config import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    n = budget_bytes // bytes_per_block(cfg, block_size, dtype)
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({bytes_per_block(cfg, block_size, dtype)} bytes each); raise kv_cache_memory")
    return int(n)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


def kv_budget_bytes(device: torch.device, fraction: float, explicit: int | None, cpu_default: int) -> int:
    if explicit is not None:
        return explicit
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(cpu_default * fraction)
