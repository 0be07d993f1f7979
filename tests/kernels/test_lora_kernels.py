"""The segment-wise LoRA products: Triton (compiled on CUDA, else interpreted on the CPU;
tests/triton_mode.py) and torch, both against a row-by-row fp32 reference.

Cases mix base rows (no adapter) with segments of different slots, ranks below the pool's (zeros
past them) and an output that is a column slice of a wider tensor (q/k/v of a fused projection).
Bounds, max|out - ref| <= tol * max|ref|: fp32 1e-5; bf16 (inputs and output rounded to bf16,
u = 2^-8; Triton accumulates in fp32, torch rounds the rank-r intermediate too) 2e-2.
"""
import pytest
import torch

from tests.triton_mode import DEVICE, INTERPRETED, patch_interpreter_bf16

pytest.importorskip("triton", reason="triton is not installed: the LoRA Triton kernel cannot be checked")

from tokenyard.kernels import lora_torch, lora_triton  # noqa: E402

CASES = [  # rows, in, out, slots, pool rank, ranks per slot
    (37, 64, 48, 3, 24, [24, 8, 16]),
    (5, 96, 40, 2, 16, [16, 1]),       # decode-sized, odd widths
    (70, 32, 64, 4, 64, [64, 32, 8, 4]),
]


def _case(rows, k, n, slots, pool_rank, ranks, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    a = torch.randn(slots, pool_rank, k, generator=g) / k ** 0.5
    b = torch.randn(slots, n, pool_rank, generator=g) / pool_rank ** 0.5
    for s, r in enumerate(ranks):
        a[s, r:] = 0
        b[s, :, r:] = 0
    scales = torch.rand(slots, generator=g) + 0.5
    row_slots = torch.randint(-1, slots, (rows,), generator=g).tolist()
    y = torch.randn(rows, 2 * n, generator=g)
    x, a, b, y = (t.to(dtype) for t in (x, a, b, y))
    ref = y.float().clone()
    for i, s in enumerate(row_slots):
        if s >= 0:
            ref[i, n:] += scales[s] * (x[i].float() @ a[s].float().T) @ b[s].float().T
    return x, a, b, scales, y, row_slots, ref


def _segments(row_slots, ranks, scales, device, tensors):
    seg = lora_torch.build_segments(row_slots, device, with_tensors=tensors)
    seg.ranks = [ranks[s] for s in seg.slots]
    seg.scales = [float(scales[s]) for s in seg.slots]
    return seg


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_the_reference(case, dtype, tol, monkeypatch):
    if dtype == torch.bfloat16 and INTERPRETED:
        patch_interpreter_bf16(monkeypatch)
    x, a, b, scales, y, row_slots, ref = _case(*case, dtype)
    seg = _segments(row_slots, case[5], scales, DEVICE, True)
    out = y.to(DEVICE)
    lora_triton.lora_add(out[:, case[2]:], x.to(DEVICE), a.to(DEVICE), b.to(DEVICE), scales.to(DEVICE), seg)
    err = (out.float().cpu() - ref).abs().max() / ref.abs().max()
    assert err.item() <= tol
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out.cpu()[base_rows], y[base_rows])          # base rows untouched
    assert torch.equal(out.cpu()[:, :case[2]], y[:, :case[2]])      # columns outside the slice untouched


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_torch_matches_the_reference(case, dtype, tol):
    x, a, b, scales, y, row_slots, ref = _case(*case, dtype)
    seg = _segments(row_slots, case[5], scales, torch.device("cpu"), False)
    out = y.clone()
    lora_torch.lora_add(out[:, case[2]:], x, a, b, seg)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err.item() <= tol
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out[base_rows], y[base_rows])


@pytest.mark.parametrize("case", CASES)
def test_the_batched_form_matches_the_reference(case):
    """lora_add_batched on the pool's layout (B transposed, [slots, R, out]): segments padded, two bmm."""
    x, a, b, scales, y, row_slots, ref = _case(*case, torch.float32)
    seg = _segments(row_slots, case[5], scales, torch.device("cpu"), False)
    lora_torch.batched_layout(seg, len(row_slots), case[3], torch.float32, torch.device("cpu"))
    out = y.clone()
    lora_torch.lora_add_batched(out[:, case[2]:], x, a, b.transpose(1, 2).contiguous(), seg)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out[base_rows], y[base_rows])


@pytest.mark.parametrize("row_slots", [
    [0, 1, -1, 0, 1, -1],     # every slot's rows equal (no padding left): base rows need one more position
    [1, 0, 0, 1],             # no base row, no padding
    [-1, 2, -1, -1],          # one adapter, the other slots empty
])
def test_the_batched_form_where_padding_runs_out(row_slots):
    """The base rows read a zero-scaled padding position; batched_layout adds one when none is left."""
    slots, n = 3, 24
    x, a, b, scales, y, _, _ = _case(len(row_slots), 32, n, slots, 8, [8, 4, 8], torch.float32)
    ref = y.clone()
    for i, s in enumerate(row_slots):
        if s >= 0:
            ref[i, n:] += scales[s] * (x[i] @ a[s].T) @ b[s].T
    seg = _segments(row_slots, [8, 4, 8], scales, torch.device("cpu"), False)
    lora_torch.batched_layout(seg, len(row_slots), slots, torch.float32, torch.device("cpu"))
    out = y.clone()
    lora_torch.lora_add_batched(out[:, n:], x, a, b.transpose(1, 2).contiguous(), seg)
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-5
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(out[base_rows], y[base_rows])


def test_triton_reads_the_pools_strided_b():
    """The pool keeps B transposed, [slots, R, out]; the kernel gets its [slots, out, R] view, strided."""
    case = CASES[0]
    x, a, b, scales, y, row_slots, ref = _case(*case, torch.float32)
    seg = _segments(row_slots, case[5], scales, DEVICE, True)
    pool_b = b.transpose(1, 2).contiguous().to(DEVICE)          # [slots, R, N]
    out = y.to(DEVICE)
    lora_triton.lora_add(out[:, case[2]:], x.to(DEVICE), a.to(DEVICE), pool_b.transpose(1, 2), scales.to(DEVICE), seg)
    assert ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item() <= 1e-5


def test_no_adapter_rows_give_no_segments():
    assert lora_torch.build_segments([-1, -1, -1], torch.device("cpu")) is None
