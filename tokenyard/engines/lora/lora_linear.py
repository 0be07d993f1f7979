"""The adapters' share of one decoder layer's projections, added to the base layer's output.

The decoder fuses q/k/v into qkv_proj and gate/up into gate_up_proj (tokenyard/engines/model/model.py);
PEFT adapts them one by one. So each fused output is cut into its modules' column slices and each
slice gets its own module's products, in place:

    y = base_proj(x)                       # any base: float, int8, int4 (QuantLinear), oneDNN-packed
    y[:, off:off + n] += scale * B(A x)    # per adapter segment, for each adapted module of the group

The layer holds a LayerLora only when the engine serves adapters; while no step has set the pool's
segments (base-only steps, embeddings, the decode fast paths) apply() returns y untouched. The
products run in torch (tokenyard/kernels/lora_torch.py) on a CPU and in Triton
(tokenyard/kernels/lora_triton.py) on CUDA.
"""
from __future__ import annotations

import torch

from tokenyard.engines.lora.adapter_pool import AdapterPool
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.kernels import lora_torch

# The decoder's fused projections, by the group name the model passes, and their modules in order.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


class LayerLora:
    def __init__(self, pool: AdapterPool, layer: int, cfg: ModelConfig) -> None:
        self.pool = pool
        self.layer = layer
        widths = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size, "o_proj": cfg.hidden_size,
                  "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
        self.slices: dict[str, list[tuple[str, int, int]]] = {}
        for group, modules in GROUPS.items():
            off = 0
            cuts = []
            for m in modules:
                if m in pool.modules:
                    cuts.append((m, off, widths[m]))
                off += widths[m]
            self.slices[group] = cuts

    def apply(self, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus this step's adapter products, for the rows that have one."""
        seg = self.pool.segments
        if seg is None:
            return y
        pool, layer = self.pool, self.layer
        for module, off, n in self.slices[group]:
            out = y[:, off:off + n]
            if pool.triton:
                from tokenyard.kernels import lora_triton  # imported only on CUDA
                lora_triton.lora_add(out, x.contiguous(), pool.a_of(module, layer), pool.b_of(module, layer),
                                     pool.scales, seg)
            elif seg.mask is not None:
                lora_torch.lora_add_dense(out, x, pool.a[module][layer], pool.b[module][layer], seg.mask)
            else:
                lora_torch.lora_add(out, x, pool.a_of(module, layer), pool.b_of(module, layer), seg)
        return y


def attach(model: torch.nn.Module, pool: AdapterPool) -> None:
    """Give every decoder layer of model its LayerLora."""
    for i, layer in enumerate(model.layers):
        layer.lora = LayerLora(pool, i, model.cfg)
