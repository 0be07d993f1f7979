"""`QuantLinear`: a weight-only quantised stand-in for `nn.Linear`, repacked for its backend.

It is built from a device-neutral layout (`tokenyard.kernels.quant_layout`: `Int8Weight` or `Int4Weight`)
and keeps only what its backend reads:

- "cpu": torch's packed weight-only CPU ops, which are fast only with bf16 activations, so the
  input is cast to bf16 and the output back to the input's dtype.
  int8: `aten._weight_int8pack_mm(x bf16 [M, K], w int8 [N, K], scales bf16 [N])` uses the
  stored int8 values as they are (needs K % 16 == 0; other K give wrong results or crash).
  int4: `aten._convert_weight_to_int4pack_for_cpu(q int32 [N, K], 1)` repacks the nibbles and
  `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scale_and_zero bf16 [K/g, N, 2])`
  computes w = (q - 8) * scale + zero'. Ours is w = (q - z) * scale, so
  zero' = (8 - z) * scale (needs N % 16 == 0: other N are padded with zero rows here).
  The float-minimum form (w = q * scale + min, GGUF Q4_1) maps as zero' = min + 8 * scale. Scale
  and zero' are stored in bf16 by this op, so the CPU weight matches the layout's only to bf16
  rounding of both (tests/engines/test_gguf_quant.py measures it).
- "triton": `tokenyard.kernels.quant_matmul_triton` reads the stored layout directly (CUDA).
- "torch": `tokenyard.kernels.quant_matmul_torch`, the reference (dequantises per call: slow, exact in
  fp32); used where a packed op is missing or a shape does not suit it.
The environment variable TOKENYARD_QUANT_BACKEND (cpu, triton or torch) replaces "auto" when set,
in every process of an engine (its tensor/pipeline-parallel workers inherit it): the reference
backend makes a quantised engine's fp32 math comparable across rank counts (the packed CPU ops
round each partial product to bf16), which the quantised tensor-parallel tests rely on.

On the "cpu" backend, calls with at least INT8_DENSE_MIN_ROWS / INT4_DENSE_MIN_ROWS rows (prefill)
dequantise the packed weight to bf16 tile by tile and run dense GEMMs instead of the packed
op: the same weights (the packed op's, rounded to bf16), at the GEMM's rate (see the constants).
The GEMMs are bf16 where this CPU multiplies bf16 fast and fp32 where it does not
(tokenyard.kernels.cpu_gemm measures that once per process).
"""
from __future__ import annotations

import torch
from torch import nn

from tokenyard import knobs
from tokenyard.kernels import quant_matmul_torch as ref_ops
from tokenyard.kernels.cpu_gemm import dense_dtype
from tokenyard.kernels.quant_layout import Int4Weight, Int8Weight, unpack_int4
from tokenyard.kernels.quant_matmul_torch import int4pack_cpu_layout, int4pack_dense_mm, int4pack_dense_tiles, int8_dense_mm

BACKENDS = knobs.QUANT_BACKENDS


def _cpu_op(name: str):
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


_INT8_MM = _cpu_op("_weight_int8pack_mm")
_INT4_PACK = _cpu_op("_convert_weight_to_int4pack_for_cpu")
_INT4_MM = _cpu_op("_weight_int4pack_mm_for_cpu")


def _pick_backend(requested: str, device: torch.device, int4: bool, n: int, k: int) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"unknown quantised matmul backend {requested!r}; available: {', '.join(BACKENDS)}")
    if requested == "auto":
        requested = knobs.quant_backend()
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "triton" if k % 32 == 0 else "torch"
    if device.type == "cpu":
        if int4 and _INT4_PACK is not None and _INT4_MM is not None:
            return "cpu"
        if not int4 and _INT8_MM is not None and k % 16 == 0:
            return "cpu"
    return "torch"


# Prefill on the CPU: from this many rows (tokens in the step) on, the "cpu" backend dequantises
# the weight to bf16 tile by tile and runs dense bf16 GEMMs instead of torch's packed op
# (tokenyard.kernels.quant_matmul_torch: int8_dense_mm, int4pack_dense_mm). The packed ops cost about the
# same per row at any M (a GEMV loop), so they win for decode batches and lose for prefill chunks;
# the dequantisation costs the same at any M, so the crossover is where the packed op's per-row
# excess pays for one dequantisation of the weight. Measured per projection shape of SmolLM2-135M
# and of the 200M Llama, 8 to 512 rows (`python -m tokenyard.bench.quant_prefill --thresholds --threads 1
# --cpu-time`, bench/results/quant_prefill_thresholds_t1_cpu.json, bench/RESULTS.md "Weight-only
# quantisation"): int8's dense path wins from 48 rows on (32 on two shapes) and int4's, whose
# dequantisation costs about twice int8's per weight (unpacking the nibbles), from 96 on every
# shape. One threshold per mode: the crossovers do not depend on the shape here. Eager calls only: a compiled graph
# (the CPU decode step) takes the packed op at every size, with no guard on its row count
# (see _forward_cpu).
INT8_DENSE_MIN_ROWS = 48
INT4_DENSE_MIN_ROWS = 96
# The dequantised weight is transient and made per column tile of at most this many weights (2 MiB
# of bf16, after 4 MiB fp32 intermediates): a layer's whole dense copy never exists when it is
# larger (an LM head: 28 tiles for SmolLM2's). Tiles of 4M weights dequantised up to 1.4x slower
# per weight than tiles of 1M (the intermediates fall out of cache); tiles of 64-128K make the
# GEMMs narrow and the whole call 1.2-1.5x slower (this 2-core VM, 1 thread, thread CPU time).
DENSE_TILE_WEIGHTS = 1 << 20


class QuantLinear(nn.Module):
    """y = x @ dequantize(weight).T + bias, for x [..., K]; output in x's dtype."""

    def __init__(self, weight: Int8Weight | Int4Weight, bias: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        super().__init__()
        self.int4 = isinstance(weight, Int4Weight)
        if self.int4:
            n, k = weight.packed.shape[0], weight.packed.shape[1] * 2
            device = weight.packed.device
            self.group_size = weight.group_size
        else:
            n, k = weight.w_q.shape
            device = weight.w_q.device
            self.group_size = 0
        self.in_features, self.out_features = k, n
        self.backend = _pick_backend(backend, device, self.int4, n, k)
        self._n_padded = n
        if self.backend == "cpu":
            self._pack_cpu(weight)
        elif self.int4:
            self.register_buffer("packed", weight.packed.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.float().contiguous(), persistent=False)
            self.register_buffer("zeros", None if weight.zeros is None else weight.zeros.contiguous(),
                                 persistent=False)
            self.register_buffer("mins", None if weight.mins is None else weight.mins.float().contiguous(),
                                 persistent=False)
        else:
            self.register_buffer("w_q", weight.w_q.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.float().contiguous(), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def prepared_state(self) -> dict:
        """What `from_prepared` needs beside the buffers (JSON-able): the prepared-weights cache
        (tokenyard/engines/quant/prepared_model.py) keeps this layer as packed, not repacked."""
        return {"int4": self.int4, "group_size": self.group_size, "in_features": self.in_features,
                "out_features": self.out_features, "backend": self.backend, "n_padded": self._n_padded,
                "buffers": list(self._buffers)}

    @classmethod
    def from_prepared(cls, state: dict, buffers: dict[str, torch.Tensor | None]) -> "QuantLinear":
        """A layer as `prepared_state()` and its buffers describe it, with no repacking (the same
        torch and CPU made them: the cache's key says so)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.int4 = bool(state["int4"])
        self.group_size = int(state["group_size"])
        self.in_features, self.out_features = int(state["in_features"]), int(state["out_features"])
        self.backend = str(state["backend"])
        self._n_padded = int(state["n_padded"])
        for name in state["buffers"]:
            self.register_buffer(name, buffers.get(name), persistent=False)
        if self.backend == "cpu" and self.int4:
            self._layout = int4pack_cpu_layout()
            self._dense_tiles = (int4pack_dense_tiles(self._n_padded, self._layout,
                                                      max(1, DENSE_TILE_WEIGHTS // self.in_features))
                                 if self._layout else None)
        return self

    @property
    def mode(self) -> str:
        return "int4" if self.int4 else "int8"

    def _pack_cpu(self, weight: Int8Weight | Int4Weight) -> None:
        if not self.int4:
            self.register_buffer("w_q", weight.w_q.contiguous(), persistent=False)
            self.register_buffer("scales", weight.scales.to(torch.bfloat16).contiguous(), persistent=False)
            return
        q = unpack_int4(weight.packed).to(torch.int32)
        scales = weight.scales.float()
        if weight.mins is not None:  # q * s + m == (q - 8) * s + (m + 8 * s)
            shifted_zero = weight.mins.float() + 8.0 * scales
        else:
            shifted_zero = (8.0 - weight.zeros.float()) * scales
        pad = -self.out_features % 16
        if pad:  # zero rows: q = 0, scale = 0, zero' = 0 -> w = 0; the extra outputs are sliced off
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])])
            shifted_zero = torch.cat([shifted_zero, shifted_zero.new_zeros(pad, scales.shape[1])])
        self._n_padded = self.out_features + pad
        self.register_buffer("packed", _INT4_PACK(q.contiguous(), 1), persistent=False)
        sz = torch.stack([scales, shifted_zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scale_zero", sz.to(torch.bfloat16), persistent=False)
        # The dense prefill path reads `packed` in place; None when this torch packs in a layout
        # tokenyard.kernels.quant_matmul_torch cannot read (then the packed op runs at any M).
        self._layout = int4pack_cpu_layout()
        self._dense_tiles = (int4pack_dense_tiles(self._n_padded, self._layout,
                                                  max(1, DENSE_TILE_WEIGHTS // self.in_features))
                             if self._layout else None)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.int4 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{g}, "
                f"backend={self.backend}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "cpu":
            y = self._forward_cpu(x2).to(x.dtype)
        elif self.backend == "triton":
            from tokenyard.kernels import quant_matmul_triton as triton_ops  # imported only on CUDA
            if self.int4:
                y = triton_ops.int4_matmul(x2, self.packed, self.scales, self.zeros, self.group_size, mins=self.mins)
            else:
                y = triton_ops.int8_matmul(x2, self.w_q, self.scales)
        elif self.int4:
            y = ref_ops.int4_matmul(x2, self.packed, self.scales, self.zeros, self.group_size, mins=self.mins)
        else:
            y = ref_ops.int8_matmul(x2, self.w_q, self.scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _forward_cpu(self, x2: torch.Tensor) -> torch.Tensor:
        if x2.shape[0] == 0:  # e.g. a prefill-only step samples no row
            return x2.new_empty(0, self.out_features, dtype=torch.bfloat16)
        xb = x2.to(torch.bfloat16).contiguous()
        # Eager calls pick the path by the row count. Under torch.compile the packed op, the decode
        # path, runs at every size: the compiled CPU decode graph for batch 2..max_num_seqs has a
        # dynamic row count, and a branch on it would guard the range at the threshold (dynamo's
        # ConstraintViolationError under mark_dynamic; tests/engines/test_quant_prefill.py). Prefill, where
        # the dense path pays, runs eagerly (tokenyard/engines/model/compiled_decoder.py).
        m = xb.shape[0]
        eager = not torch.compiler.is_compiling()
        # The dense paths multiply in bf16 where this CPU's bf16 GEMM is fast, else in fp32 on the
        # same bf16-rounded weights (an AVX2-only CPU runs bf16 GEMMs ~60x slower; tokenyard.kernels.cpu_gemm).
        # Either way the input is the bf16-rounded xb the packed op reads: the products are the packed
        # op's, so a prompt prefilled densely and a suffix recomputed by the packed op (prefix-cache
        # hits, seeded n > 1) differ only by accumulation order.
        # The output is bf16 on every path, as the packed ops give it: an fp32 dense GEMM (AVX2-only
        # CPUs) rounds once at the end, so the rows and rank counts agree on every machine (tensor
        # parallelism rounds its fp32 partial sums once the same way: tokenyard/engines/tp/fp32_partials.py).
        if not self.int4:
            if eager and m >= INT8_DENSE_MIN_ROWS:
                return int8_dense_mm(xb.to(dense_dtype()), self.w_q, self.scales,
                                     max(1, DENSE_TILE_WEIGHTS // self.in_features)).to(torch.bfloat16)
            return _INT8_MM(xb, self.w_q, self.scales)
        if eager and m >= INT4_DENSE_MIN_ROWS and self._dense_tiles is not None:
            y = int4pack_dense_mm(xb.to(dense_dtype()), self.packed, self.scale_zero, self._n_padded, self.in_features,
                                  self.group_size, self._layout, self._dense_tiles).to(torch.bfloat16)
        else:
            y = _INT4_MM(xb, self.packed, self.group_size, self.scale_zero)
        return y[:, :self.out_features] if self._n_padded != self.out_features else y
