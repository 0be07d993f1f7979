"""Batched LoRA products in torch, segment by segment (the CPU path and the reference for Triton).

    y[rows] += scale[slot] * (x[rows] @ A[slot, :r].T) @ B[slot, :, :r].T     for each segment

A step's token rows are grouped by adapter before the call (`LoraSegments`): `perm` lists the rows
that have an adapter, sorted so each adapter's rows are contiguous, and segment i covers
perm[starts[i]:starts[i + 1]], all for pool slot slots[i] of rank ranks[i]. Rows of base-model
requests are in no segment and cost nothing. The pool (tokenyard/engines/lora/adapter_pool.py)
keeps every slot at the pool's largest rank with zeros past the adapter's own: slicing to the
adapter's rank here skips the zeros' work, and a zero-padded product would give the same sum.

`y` may be a column slice of a fused projection's output (q, k and v of qkv_proj): the product is
added in place through index_add_, which writes through the view.

The batched form (`lora_add_batched`, small steps on a CPU) trades a little work for far fewer calls:
the rows are laid out as [slots, M, K] (M: the longest segment; shorter segments and slots without rows
padded with row 0 at scale 0) and each fused projection is two batched GEMMs (torch.bmm) against every
slot's A and B, a per-row scale (zero for padding) between them, and one gather of the products back
into the rows' order (`pad_inv`: each row's padded position; a base row points at a padding position,
whose product is zero) added to y: five calls per projection whatever the number of adapters, and no
product of a row with another adapter's weights. B is read as [slots, R, N], contiguous (the pool's
layout), so the expand GEMM streams it once; a gather + add_ is about half an index_add_'s time at
these sizes (tokenyard/bench/lora_bench.py). The result is the segment form's up to summation order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoraSegments:
    """One step's rows grouped by adapter (built once per step, read by every layer)."""

    perm: torch.Tensor          # [R] long: row indices, each adapter's rows contiguous
    starts: list[int]           # [S + 1] segment bounds in perm
    slots: list[int]            # [S] pool slot of each segment
    ranks: list[int]            # [S] the adapter's own rank
    scales: list[float]         # [S] the adapter's scale (alpha / r, or alpha / sqrt(r) for rsLoRA)
    # The same as tensors on the device, for the Triton kernels (None on the torch path).
    starts_t: torch.Tensor | None = None
    slots_t: torch.Tensor | None = None
    max_len: int = 0            # the longest segment's row count
    # the batched form (batched_layout): row index per (slot, position) and its scale (0: padding)
    pad_idx: torch.Tensor | None = None        # [slots * M] long: the row at each padded position
    pad_scale: torch.Tensor | None = None      # [slots, M, 1]
    pad_inv: torch.Tensor | None = None        # [T] long: each row's padded position (base rows: a padding one)
    # the C kernel's descriptor of these segments (tokenyard/kernels/cpu_lora_native.py), when it serves
    native: object | None = None

    @property
    def num_segments(self) -> int:
        return len(self.slots)


def build_segments(row_slots: list[int], device: torch.device, with_tensors: bool = False) -> LoraSegments | None:
    """Group rows by slot (-1: no adapter). None when no row has an adapter."""
    by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(row)
    if not by_slot:
        return None
    perm: list[int] = []
    starts = [0]
    slots = []
    for slot in sorted(by_slot):
        perm.extend(by_slot[slot])
        starts.append(len(perm))
        slots.append(slot)
    seg = LoraSegments(torch.tensor(perm, dtype=torch.long, device=device), starts, slots, [0] * len(slots),
                       [1.0] * len(slots), max_len=max(b - a for a, b in zip(starts, starts[1:])))
    if with_tensors:
        seg.starts_t = torch.tensor(starts, dtype=torch.int32, device=device)
        seg.slots_t = torch.tensor(slots, dtype=torch.int32, device=device)
    return seg


def lora_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments) -> None:
    """y [T, N] += the adapters' products of x [T, K] (in place). a: [slots, R, K]; b: [slots, N, R]."""
    for i, slot in enumerate(seg.slots):
        lo, hi = seg.starts[i], seg.starts[i + 1]
        r = seg.ranks[i] or a.shape[1]
        rows = seg.perm[lo:hi]
        xs = x.index_select(0, rows)
        t = (xs @ a[slot, :r].T) * seg.scales[i]
        y.index_add_(0, rows, (t @ b[slot, :, :r].T).to(y.dtype))


def batched_layout(seg: LoraSegments, num_rows: int, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
    """Fill seg.pad_idx / pad_scale / pad_inv for lora_add_batched, for a step of num_rows rows (every
    pool slot, M = the longest segment, one more when the step has base rows and no padding position
    is left for them to read)."""
    rows = num_rows
    m = seg.max_len
    if rows > seg.starts[-1] and num_slots * m == seg.starts[-1]:
        m += 1
    used = [0] * num_slots
    for i, slot in enumerate(seg.slots):
        used[slot] = seg.starts[i + 1] - seg.starts[i]
    # a padding position for the base rows to read (zero product); 0 when there are neither
    spare = next((slot * m + n for slot, n in enumerate(used) if n < m), 0)
    idx = torch.zeros(num_slots * m, dtype=torch.long)
    scale = torch.zeros(num_slots, m, 1, dtype=dtype)
    inv = torch.full((rows,), spare, dtype=torch.long)
    perm = seg.perm.cpu()
    for i, slot in enumerate(seg.slots):
        lo, hi = seg.starts[i], seg.starts[i + 1]
        pos = torch.arange(slot * m, slot * m + hi - lo)
        idx[pos] = perm[lo:hi]
        inv[perm[lo:hi]] = pos
        scale[slot, :hi - lo] = seg.scales[i]
    seg.pad_idx, seg.pad_scale, seg.pad_inv = idx.to(device), scale.to(device), inv.to(device)


def lora_add_batched(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg: LoraSegments) -> None:
    """y [T, N] += for each row, its slot's scale * B(Ax), in place. a: [slots, R, K]; b: [slots, R, N]
    (the pool's layout, B transposed); seg: with batched_layout's tensors."""
    assert seg.pad_idx is not None and seg.pad_scale is not None and seg.pad_inv is not None
    slots, m = seg.pad_scale.shape[0], seg.pad_scale.shape[1]
    xp = x.index_select(0, seg.pad_idx).view(slots, m, -1)
    t = torch.bmm(xp, a.transpose(1, 2)).mul_(seg.pad_scale)
    out = torch.bmm(t, b).view(slots * m, -1)
    y.add_(out.index_select(0, seg.pad_inv))
