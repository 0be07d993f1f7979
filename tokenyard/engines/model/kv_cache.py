"""KV cache tensors: one K and one V cache per layer, addressed by slot.

kv_cache_dtype "auto" stores K/V in the model's dtype (plain tensors); "int8" and "fp8_e4m3"
store codes plus one fp32 scale per (kv head, slot) (tokenyard/kernels/kv_quant.py: `QuantizedCache`). The
block count follows the byte budget either way, so a quantised cache holds 2x (vs bf16) to
3.8x (vs fp32, head_dim 64) the blocks in the same kv_cache_memory.
"""
from __future__ import annotations

import math
import mmap

import torch

from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.kernels import kv_quant
from tokenyard.kernels.kv_quant import QuantizedCache

LayerCache = tuple[torch.Tensor, torch.Tensor] | tuple[QuantizedCache, QuantizedCache]


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block over all layers, K and V, scales included."""
    store = kv_quant.storage_dtype(kv_cache_dtype) or dtype
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * kv_quant.bytes_per_token_head(cfg.head_dim, store)


def num_blocks_for(cfg: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int,
                   kv_cache_dtype: str = "auto") -> int:
    per_block = bytes_per_block(cfg, block_size, dtype, kv_cache_dtype)
    n = budget_bytes // per_block
    if n < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {block_size} tokens "
            f"({per_block} bytes each); raise kv_cache_memory")
    return int(n)


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, kv_cache_dtype: str = "auto") -> list[LayerCache]:
    shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
    store = kv_quant.storage_dtype(kv_cache_dtype)
    if store is not None:
        return [(kv_quant.allocate(*shape, store, device), kv_quant.allocate(*shape, store, device))
                for _ in range(cfg.num_layers)]
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(cfg.num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On a CPU: fresh anonymous pages, which the kernel zeroes as each is
    first written, so start-up does not fault in and zero the whole budget (SmolLM2's 384 MiB:
    0.1-0.45 s of a replica's start on this VM) and unused blocks cost no memory."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    nbytes = count * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)


def check_kv_cache_dtype(name: str, device: torch.device, attention_backend: str) -> None:
    """Raise ValueError at start-up when this device (or attention backend) cannot store or read
    kv_cache_dtype `name`. attention_backend is the resolved one ("torch" or "triton")."""
    kv_quant.check_device(name, device)
    if name == "fp8_e4m3" and device.type == "cuda" and attention_backend == "triton":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer for the "
                             f"Triton kernels' fp8 conversions; {device} is {major}.{minor}: use int8")


def kv_cache_dtype_name(kv_cache_dtype: str, dtype: torch.dtype) -> str:
    """What the cache stores, as reported in stats: "int8", "fp8_e4m3", or the model's dtype."""
    return kv_cache_dtype if kv_cache_dtype != "auto" else str(dtype).removeprefix("torch.")


def kv_budget_bytes(device: torch.device, fraction: float, explicit: int | None, cpu_default: int) -> int:
    if explicit is not None:
        return explicit
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return int(cpu_default * fraction)
