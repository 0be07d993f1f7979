"""The adapters' share of one decoder layer's projections, added to the base layer's output.

The decoder fuses q/k/v into qkv_proj and gate/up into gate_up_proj (tokenyard/engines/model/model.py);
PEFT adapts them one by one. So each fused output is cut into its modules' column slices and each
slice gets its own module's products, in place (the batched form does a whole group at once: the pool
keeps a group's B block-diagonal over its modules, tokenyard/engines/lora/adapter_pool.py):

    y = base_proj(x)                       # any base: float, int8, int4 (QuantLinear), oneDNN-packed
    y[:, off:off + n] += scale * B(A x)    # per adapter segment, for each adapted module of the group

The layer holds a LayerLora only when the engine serves adapters; while no step has set the pool's
segments (base-only steps, embeddings, the decode fast paths) apply() returns y untouched. The
products run in C on a CPU with an fp32 pool (tokenyard/kernels/cpu_lora.c, one call per fused projection),
else in torch (tokenyard/kernels/lora_torch.py), and in Triton (tokenyard/kernels/lora_triton.py) on CUDA.
"""
from __future__ import annotations

import torch

from tokenyard.engines.lora.adapter_loader import group_layout
from tokenyard.engines.lora.adapter_pool import AdapterPool
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.kernels import lora_torch


class LayerLora:
    def __init__(self, pool: AdapterPool, layer: int, cfg: ModelConfig) -> None:
        self.pool = pool
        self.layer = layer
        # group -> the adapted modules in it: (module, output column offset, width)
        self.slices = {g: [(m, off, n) for m, off, n in cuts if m in pool.modules]
                       for g, (_, _, cuts) in group_layout(cfg).items()}
        # This layer's A and B of each group, as views: the pool's tensors are allocated once and
        # written in place, so the views stay valid; taking them here spares two indexing calls per
        # group and step (a decode step calls apply 4 x layers times).
        self.a = {g: pool.a[g][layer] for g in pool.groups}
        self.b = {g: pool.b[g][layer] for g in pool.groups}
        # The C kernel's descriptor of each group (tokenyard/kernels/cpu_lora_native.py), when the pool has
        # the kernel: made once, as it points into the pool's tensors (allocated once, written in place).
        self.native = {}
        if pool.native is not None:
            for g in pool.groups:
                mods = [(j, off, n) for j, (m, off, n) in enumerate(group_layout(cfg)[g][2]) if m in pool.modules]
                if mods and pool.native.supports(self.a[g], len(mods), pool.rank):
                    self.native[g] = pool.native.group(self.a[g], self.b[g], pool.rank, mods)

    def apply(self, group: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base projection of x) plus this step's adapter products, for the rows that have one."""
        seg = self.pool.segments
        if seg is None:
            return y
        if not self.slices[group]:
            return y
        if seg.native is not None and group in self.native and y.stride(1) == 1:   # CPU, fp32: one C call
            self.pool.native.add(y, x, self.native[group], seg.native)
            return y
        if seg.pad_idx is not None:   # small CPU steps: the whole group, every slot, batched GEMMs
            lora_torch.lora_add_batched(y, x, self.a[group], self.b[group], seg)
            return y
        pool, layer = self.pool, self.layer
        for module, off, n in self.slices[group]:
            out = y[:, off:off + n]
            if pool.triton:
                from tokenyard.kernels import lora_triton  # imported only on CUDA
                lora_triton.lora_add(out, x.contiguous(), pool.a_of(module, layer), pool.b_of(module, layer),
                                     pool.scales, seg)
            else:
                lora_torch.lora_add(out, x, pool.a_of(module, layer), pool.b_of(module, layer), seg)
        return y


def attach(model: torch.nn.Module, pool: AdapterPool) -> None:
    """Give every decoder layer of model its LayerLora."""
    for i, layer in enumerate(model.layers):
        layer.lora = LayerLora(pool, i, model.cfg)
