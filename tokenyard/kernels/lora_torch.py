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

The dense form (`lora_add_dense`, small steps on a CPU) trades work for calls: every row is multiplied by
the A of every slot in one GEMM ([T, K] x [K, slots * R]), a mask built once per step keeps each row's own
slot's columns times its scale (zero for base rows and other slots), and one more GEMM against the B of
every slot side by side ([slots * R, N]) adds the products. Per projection that is three calls whatever
the number of adapters, against five per segment; at decode sizes the extra multiplications cost less
than the calls they save. The result is the segment form's up to summation order.
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
    # the dense form's masks (dense_mask), by columns per slot; None: the segment form
    masks: dict[int, torch.Tensor] | None = None

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


def dense_mask(row_slots: list[int], slot_scales: list[float], rank: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """[T, slots * rank]: row i holds its slot's scale over that slot's rank columns, zeros elsewhere
    (a handful of tensor ops, not a Python loop over the rows: it is built every step)."""
    rows = torch.tensor(row_slots, dtype=torch.long)
    scales = torch.tensor([*slot_scales, 0.0], dtype=dtype)          # slot -1 (base rows) reads the 0.0
    onehot = torch.nn.functional.one_hot(rows.clamp(min=0), len(slot_scales)).to(dtype) * scales[rows][:, None]
    return onehot[:, :, None].expand(-1, -1, rank).reshape(len(row_slots), -1).to(device)


def lora_add_dense(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
    """y [T, N] += for each row, its slot's scale * B(Ax), in place. a: [slots, R, K] (contiguous);
    b: [N, slots, R] (contiguous: the pool's layout); mask: dense_mask's [T, slots * R]."""
    t = (x @ a.reshape(-1, a.shape[-1]).T) * mask
    y.addmm_(t, b.reshape(b.shape[0], -1).T)
