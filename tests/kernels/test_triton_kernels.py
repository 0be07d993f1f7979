"""Triton kernels against their torch references: compiled on a CUDA device, else on the CPU
under Triton's interpreter (tests/triton_mode.py decides, once per run).

Every output is poisoned with NaN before the kernel runs, so an element the kernel forgets to
write fails the bound; the KV cache is poisoned too outside the slots sequences own, so a kernel
reading a slot it should not (past a sequence's end, a padded block-table entry) fails as well.
Inputs are drawn on the CPU (the same values on every machine) and moved to the kernel's device.

Bounds, max|out - ref| <= tol * max|ref|, the reference in fp32 on the same rounded inputs:
fp32 1e-5. fp16 (unit roundoff u = 2^-11): attention 5e-3 (P rounded to fp16 before the P.V
product, the output once more), quantised matmuls 1e-3 (exact dequantised weights, fp32
accumulation, one output rounding). bf16 has the same rounding points with u = 2^-8, 8x fp16's,
so its bounds are 8x: attention 4e-2, matmuls 8e-3. Measured on the CPU (worst case over these
cases): fp16 attention 3.3e-4, matmuls 3.9e-4; bf16 attention 2.8e-3, matmuls 3.8e-3.
On the CPU the bf16 cases run the real bf16 kernels with the interpreter's bf16 arithmetic
corrected to the GPU's: its tl.dot multiplies bf16 operands as their uint16 bit patterns, its
integer-to-bf16 cast writes the integer as the bit pattern, and its fp32-to-bf16 cast truncates
where the GPU rounds to nearest even (tests/triton_mode.py). On a GPU nothing is patched and the
kernels compile for real.
"""
import pytest
import torch

from tests.triton_mode import DEVICE, INTERPRETED, patch_interpreter_bf16

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from tokenyard.kernels import paged_attention_torch as pa_ref  # noqa: E402
from tokenyard.kernels import paged_attention_triton as pa  # noqa: E402
from tokenyard.kernels import quant_layout as ql  # noqa: E402
from tokenyard.kernels import quant_matmul_torch as qm_ref  # noqa: E402
from tokenyard.kernels import quant_matmul_triton as qm  # noqa: E402

ATTN_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}
MATMUL_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _bf16_like_a_gpu(monkeypatch):
    if INTERPRETED:
        patch_interpreter_bf16(monkeypatch)


def _on(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


def _assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    out, ref = out.cpu(), ref.cpu()
    assert not out.isnan().any(), "kernel left elements unwritten (NaN poison survived)"
    err = (out.float() - ref.float()).abs().max().item()
    bound = rel * ref.float().abs().max().item()
    assert err <= bound, f"max|out-ref| = {err:.3g} > {bound:.3g}"


# ---------------------------------------------------------------------------------------------
# KV cache writes

@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_torch_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    kvh, hd, num_slots, tokens = 3, 40, 64, 11
    # k, v as strided views of a fused projection output, the way a model produces them.
    qkv = torch.randn(tokens, 4 + 2 * kvh, hd, generator=gen).to(dtype)
    k, v = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
    slots = torch.randperm(num_slots, generator=gen)[:tokens].to(torch.int32)
    slots[[2, 7]] = -1  # padding tokens write nothing
    kc = torch.full((kvh, num_slots, hd), float("nan"), dtype=dtype)
    vc = kc.clone()
    kc_dev, vc_dev, k_dev, v_dev, slots_dev = _on(kc, vc, qkv, qkv, slots)
    k_dev, v_dev = k_dev[:, 4:4 + kvh], v_dev[:, 4 + kvh:]  # the same strided views, on the device
    pa.write_kv(kc_dev, vc_dev, k_dev, v_dev, slots_dev)
    kc, vc = kc_dev.cpu(), vc_dev.cpu()
    keep = slots >= 0
    kr, vr = kc.new_full(kc.shape, float("nan")), vc.new_full(vc.shape, float("nan"))
    pa_ref.write_kv(kr, vr, k[keep].contiguous(), v[keep].contiguous(), slots[keep].long())
    for got, want in ((kc, kr), (vc, vr)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())


# ---------------------------------------------------------------------------------------------
# Paged attention

def _attention_case(query_lens, seq_lens, *, kv_heads, group, head_dim=32, block_size=16,
                    dtype=torch.float32, window=None, num_splits=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3  # spare blocks stay NaN: nothing may read them
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n])
        used += n
    kc = torch.full((kv_heads, num_blocks * block_size, head_dim), float("nan"), dtype=dtype)
    vc = kc.clone()
    for table, length in zip(tables, seq_lens):
        pos = torch.arange(length)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=gen).to(dtype)
        pa_ref.write_kv(kc, vc, k, v, slots)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    width = max(need)
    bt = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        bt[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    scale = head_dim ** -0.5

    out = torch.full_like(q, float("nan"), device=DEVICE)
    pa.paged_attention(*_on(q, kc, vc, qsl, torch.tensor(seq_lens, dtype=torch.int32), bt), block_size, scale,
                       sliding_window=window, num_splits=num_splits, out=out)
    plan = pa_ref.TorchAttentionPlan.build(query_lens, seq_lens, tables, block_size, window)
    ref = pa_ref.paged_attention(q.float(), kc.float().nan_to_num(), vc.float().nan_to_num(), plan, scale)
    _assert_close(out, ref, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode(dtype, group, num_splits):
    # One-token context, partial blocks, and 9 blocks (more than one 64-key tile).
    _attention_case([1, 1, 1, 1], [1, 17, 50, 141], kv_heads=2, group=group, dtype=dtype,
                    num_splits=num_splits, seed=group)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits):
    _attention_case([1, 1, 1], [5, 70, 200], kv_heads=2, group=4, window=37, num_splits=num_splits)


@pytest.mark.parametrize("block_size", [8, 32])
def test_decode_other_block_sizes(block_size):
    _attention_case([1, 1], [9, 97], kv_heads=1, group=4, block_size=block_size, num_splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_chunks(dtype, group):
    # A first chunk (no prefix), a chunk after a prefix, a verify pass (4 rows over a long
    # prefix), and a decode row, all in one batch. With group 1 a tile is 64 tokens, so the
    # 70-row chunk spans two tiles; with group 8 it is 8 tokens, so chunks span many.
    _attention_case([70, 9, 4, 1], [70, 46, 133, 30], kv_heads=2, group=group, dtype=dtype, seed=10 + group)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_sliding_window(num_splits):
    _attention_case([40, 6, 1], [40, 90, 81], kv_heads=2, group=2, window=19, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_group_not_a_power_of_two(num_splits):
    # 28 query heads over 4 kv heads (Qwen2-7B): groups of 7 rows padded to 8.
    _attention_case([1, 12, 1], [33, 40, 90], kv_heads=2, group=7, num_splits=num_splits)


def test_prefill_split_kv_and_odd_head_dim():
    # A verify pass over a long prefix is where split-KV pays on a GPU; head_dim 40 pads to 64.
    _attention_case([5, 3], [200, 64], kv_heads=1, group=8, head_dim=40, num_splits=4)


# ---------------------------------------------------------------------------------------------
# Quantised matmuls

def test_int8_layout_round_trip():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    q = ql.quantize_int8(w)
    assert q.w_q.dtype == torch.int8 and q.w_q.abs().max() <= 127 and q.scales.shape == (64,)
    err = (ql.dequantize_int8(q.w_q, q.scales) - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_layout_round_trip_and_packing(group_size):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(3))
    q = ql.quantize_int4(w, group_size)
    assert q.packed.shape == (16, 128) and q.packed.dtype == torch.uint8
    assert q.scales.shape == q.zeros.shape == (16, 256 // group_size)
    values = ql.unpack_int4(q.packed)
    assert torch.equal(values[:, 0::2], q.packed & 0xF)  # low nibble holds the even k
    assert torch.equal(values[:, 1::2], q.packed >> 4)
    err = (ql.dequantize_int4(q.packed, q.scales, q.zeros, group_size) - w).abs()
    half_step = (q.scales / 2).repeat_interleave(group_size, dim=1)
    assert (err <= half_step + 1e-6).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("split_k", [1, 3])
def test_int8_matmul(dtype, m, split_k):
    gen = torch.Generator().manual_seed(m)
    n, k = 128, 384
    q = ql.quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    qm.int8_matmul(*_on(x, q.w_q, q.scales), split_k=split_k, out=out)
    _assert_close(out, qm_ref.int8_matmul(x.float(), q.w_q, q.scales), MATMUL_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 3), (19, 2)])
def test_int4_matmul(dtype, group_size, m, split_k):
    gen = torch.Generator().manual_seed(group_size + m)
    n, k = 128, 384
    q = ql.quantize_int4(torch.randn(n, k, generator=gen), group_size, scale_dtype=dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    qm.int4_matmul(*_on(x, q.packed, q.scales, q.zeros), group_size, split_k=split_k, out=out)
    _assert_close(out, qm_ref.int4_matmul(x.float(), q.packed, q.scales, q.zeros, group_size),
                  MATMUL_TOL[dtype])


def test_quant_matmul_batched_input_and_partial_n_tile():
    # Leading batch dims flatten into M; N = 192 leaves a half-empty 128-wide tile at M > 64.
    gen = torch.Generator().manual_seed(5)
    q = ql.quantize_int8(torch.randn(192, 128, generator=gen))
    x = torch.randn(2, 40, 128, generator=gen)
    _assert_close(qm.int8_matmul(*_on(x, q.w_q, q.scales)), qm_ref.int8_matmul(x, q.w_q, q.scales), 1e-5)
