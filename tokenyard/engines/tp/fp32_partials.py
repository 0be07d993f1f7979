"""Row-parallel products whose partial sums are reduced in fp32, so that a tensor-parallel engine gives
the tokens of one process for bf16 and CPU-quantised models too.

Why: a row-parallel projection (o_proj, down_proj) gives each rank a partial sum over its slice of the
inputs, and the all-reduce adds them. One process rounds the whole sum once, to bf16: torch's packed
int8/int4 CPU ops always output bf16 (tokenyard/engines/model/quantized_linear.py), and a bf16 model's
linear rounds its fp32 accumulator to bf16. Ranks that round each partial to bf16 before adding them
make two roundings of 2^-9 relative where one process makes one of the sum: on a random Llama at TP=2
the logits moved by 6e-3 (relative to their largest) for int8 and int4 and 9e-3 for bf16, and greedy
tokens parted from the third one (tests/engines/test_tp_fp32_partials.py).

What: `RowParallelFp32` stands in for the rank's row-parallel module. Its forward gives the partial in
fp32 from the same bf16-rounded inputs and the same weights the single-process op multiplies (the
packed op's bf16-rounded weights, dequantised tile by tile as its dense prefill path does; a bf16
linear's weights widened), and `tp_reduce` (called by the decoder layer instead of its plain
all-reduce) adds the partials in fp32 and then rounds the sum to bf16 once, as one process does, then
to the activation dtype. What is left is the order of the fp32 additions (about 1e-7 relative), which
moves a bf16 result only when the sum lies within that of a rounding boundary.

Cost: the quantised partials dequantise their weight slice per call (the packed op reads it in place),
and a bf16 linear widens its slice per call; both only on tensor-parallel ranks. A row-parallel bias
(rank 0 only) joins the fp32 sum, where one process adds a quantised layer's bias after the rounding
(Llama-family models have none there). fp32 models and other devices keep the plain all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tokenyard.engines.model.quantized_linear import INT4_DENSE_MIN_ROWS, INT8_DENSE_MIN_ROWS, QuantLinear
from tokenyard.kernels.quant_matmul_torch import int4pack_codes


def needs_fp32_partials(module: nn.Module) -> bool:
    """Whether this rank's row-parallel module rounds its output to bf16 (and can give fp32 instead)."""
    if isinstance(module, QuantLinear):
        return module.backend == "cpu" and (not module.int4 or module._layout is not None)
    if isinstance(module, nn.Linear):
        return module.weight.device.type == "cpu" and module.weight.dtype == torch.bfloat16
    return False


class RowParallelFp32(nn.Module):
    """A rank's row-parallel projection giving its partial sum in fp32; `tp_reduce` finishes it.

    The partial is the single-process op's sum before its one rounding (each checked against the op
    on its own in tests/engines/test_tp_fp32_partials.py): torch's packed int8 op multiplies the
    bf16 inputs by the int8 codes in fp32 and then by the row's scale; its packed int4 op by
    (q - 8) * scale + zero' in fp32 from bf16 scale and zero'; their dense paths (QuantLinear's
    prefill, from INT8_DENSE_MIN_ROWS / INT4_DENSE_MIN_ROWS rows) by those weights rounded to bf16;
    a bf16 linear by its bf16 weights, accumulating in fp32."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if not needs_fp32_partials(inner):
            raise TypeError(f"no fp32 partials for {type(inner).__name__}")
        self.inner = inner
        self.out_dtype = torch.bfloat16
        if isinstance(inner, QuantLinear):
            self.in_features, self.out_features = inner.in_features, inner.out_features
        else:
            self.out_features, self.in_features = inner.weight.shape
        self._codes: torch.Tensor | None = None   # int4: q - 8 as int8 [n, k], decoded once

    def _int4_weight(self) -> torch.Tensor:
        """The packed int4 op's fp32 weight [n, k]: (q - 8) * scale + zero' (scale and zero' bf16)."""
        inner = self.inner
        if self._codes is None:
            q = int4pack_codes(inner.packed, inner._n_padded, inner.in_features, inner._layout)[:inner.out_features]
            self._codes = (q.to(torch.int16) - 8).to(torch.int8)
        sz = inner.scale_zero[:, :inner.out_features].float()          # [k / g, n, 2]
        g = inner.group_size
        scale = sz[..., 0].t().repeat_interleave(g, dim=1)
        zero = sz[..., 1].t().repeat_interleave(g, dim=1)
        return torch.addcmul(zero, self._codes.float(), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.out_dtype = x.dtype
        lead = x.shape[:-1]
        # the inputs the single-process op reads: bf16, then exactly widened
        xf = x.reshape(-1, self.in_features).to(torch.bfloat16).float()
        m, inner = xf.shape[0], self.inner
        if isinstance(inner, QuantLinear) and inner.int4:
            w = self._int4_weight()
            dense = m >= INT4_DENSE_MIN_ROWS and inner._dense_tiles is not None
            y = nn.functional.linear(xf, w.to(torch.bfloat16).float() if dense else w)
        elif isinstance(inner, QuantLinear):
            scales = inner.scales.float()
            if m >= INT8_DENSE_MIN_ROWS:
                y = nn.functional.linear(xf, (inner.w_q.float() * scales[:, None]).to(torch.bfloat16).float())
            else:
                y = nn.functional.linear(xf, inner.w_q.float()) * scales
        else:
            y = nn.functional.linear(xf, inner.weight.float())
        if inner.bias is not None:
            y = y + inner.bias.float()
        return y.reshape(*lead, self.out_features)

    def tp_reduce(self, partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        """The ranks' fp32 partials summed, rounded to bf16 once (as one process's op rounds), in the
        activations' dtype."""
        dist.all_reduce(partial, group=group)
        return partial.to(torch.bfloat16).to(self.out_dtype)


def wrap_row_parallel_(layer: nn.Module) -> None:
    """Replace the layer's o_proj and down_proj by RowParallelFp32 where they would round to bf16."""
    for name in ("o_proj", "down_proj"):
        module = getattr(layer, name)
        if needs_fp32_partials(module):
            setattr(layer, name, RowParallelFp32(module))
