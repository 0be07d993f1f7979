"""The Triton KV kernels on quantised caches (tokenyard/kernels/kv_quant.py: int8 / fp8 e4m3 codes with one
fp32 scale per kv head and slot) against the torch path: compiled on a CUDA device, else on the
CPU under Triton's interpreter (tests/triton_mode.py decides, once per run).

Writes: the kernel's codes and scales equal the torch write's (interpreter: bit for bit; a GPU
may divide with another rounding, so there every stored value is only checked within the
quantisation bound of tests/gateway/test_kv_quant.py). Padding slots (-1) write nothing.

Attention: the kernel dequantises codes in registers (K's scale on the score column, V's on the
probability column); the reference is the torch path in fp32 over the same codes dequantised to
fp32. Bounds as tests/kernels/test_triton_kernels.py (max|out - ref| <= tol * max|ref|): fp32 1e-5, bf16
4e-2 (codes are exact in bf16; the rounding points are those of the unquantised kernel).

The interpreter's fp32 -> fp8e4nv cast rounds the mantissa without carrying into the exponent
(126.8 becomes 64 instead of 128): for the fp8 cases that one cast is done by torch (round to
nearest even, which the GPU's cvt.rn.satfinite does), the same way triton_mode.py gives the
interpreter the GPU's bf16 rounding. On a GPU nothing is patched.
"""
import numpy as np
import pytest
import torch

from tests.triton_mode import DEVICE, INTERPRETED, patch_interpreter_bf16

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be checked")

from tokenyard.kernels import kv_quant  # noqa: E402
from tokenyard.kernels import paged_attention_torch as pa_ref  # noqa: E402
from tokenyard.kernels import paged_attention_triton as pa  # noqa: E402

QUANT = ("int8", "fp8_e4m3")
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def _patch_interpreter_fp8(monkeypatch) -> None:
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    real = InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return TensorHandle(bits.reshape(src.data.shape), tl.float8e4nv)
        return real(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


@pytest.fixture(autouse=True)
def _interpreter_like_a_gpu(monkeypatch):
    if INTERPRETED:
        patch_interpreter_bf16(monkeypatch)
        _patch_interpreter_fp8(monkeypatch)


def _cache(kvh: int, slots: int, hd: int, name: str) -> kv_quant.QuantizedCache:
    """A cache poisoned outside what is written: NaN codes (fp8) or -128 (int8) and NaN scales."""
    dtype = kv_quant.STORAGE_DTYPES[name]
    fill = float("nan") if dtype != torch.int8 else -128
    return kv_quant.QuantizedCache(torch.full((kvh, slots, hd), fill).to(dtype),
                                   torch.full((kvh, slots), float("nan")))


def _on(c: kv_quant.QuantizedCache) -> kv_quant.QuantizedCache:
    return kv_quant.QuantizedCache(c.data.to(DEVICE), c.scale.to(DEVICE))


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_quantises_like_torch_and_skips_padding(name, dtype):
    gen = torch.Generator().manual_seed(1)
    kvh, hd, num_slots, tokens = 3, 40, 64, 11
    qkv = (torch.randn(tokens, 4 + 2 * kvh, hd, generator=gen) * 3).to(dtype)   # k, v: strided views
    k, v = qkv[:, 4:4 + kvh], qkv[:, 4 + kvh:]
    slots = torch.randperm(num_slots, generator=gen)[:tokens].to(torch.int32)
    slots[[2, 7]] = -1
    got = (_on(_cache(kvh, num_slots, hd, name)), _on(_cache(kvh, num_slots, hd, name)))
    dev_qkv = qkv.to(DEVICE)
    pa.write_kv(*got, dev_qkv[:, 4:4 + kvh], dev_qkv[:, 4 + kvh:], slots.to(DEVICE))
    keep = slots >= 0
    want = (_cache(kvh, num_slots, hd, name), _cache(kvh, num_slots, hd, name))
    pa_ref.write_kv(*want, k[keep].float(), v[keep].float(), slots[keep].long())
    for g, w, x in zip(got, want, (k, v)):
        g = kv_quant.QuantizedCache(g.data.cpu(), g.scale.cpu())
        assert torch.equal(g.scale.isnan(), w.scale.isnan())   # exactly the kept slots written
        written = slots[keep].long()
        if INTERPRETED:
            assert torch.equal(g.bytes_view, w.bytes_view) and torch.equal(g.scale[:, written], w.scale[:, written])
        back = kv_quant.dequantize(g.data[:, written], g.scale[:, written], torch.float32)
        rows = x[keep].float().transpose(0, 1)
        s = g.scale[:, written, None]
        bound = s / 2 if name == "int8" else torch.maximum(rows.abs() / 16, s * 2.0 ** -10)
        assert (back - rows).abs().le(bound + 1e-5 * rows.abs().amax()).all()


def _attention_case(name, query_lens, seq_lens, *, kv_heads, group, head_dim=32, block_size=16,
                    dtype=torch.float32, window=None, num_splits=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n])
        used += n
    kc = _cache(kv_heads, num_blocks * block_size, head_dim, name)
    vc = _cache(kv_heads, num_blocks * block_size, head_dim, name)
    for table, length in zip(tables, seq_lens):
        pos = torch.arange(length)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = torch.randn(length, kv_heads, head_dim, generator=gen) * 2
        v = torch.randn(length, kv_heads, head_dim, generator=gen)
        pa_ref.write_kv(kc, vc, k, v, slots)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for i, table in enumerate(tables):
        bt[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"), device=DEVICE)
    pa.paged_attention(q.to(DEVICE), _on(kc), _on(vc), qsl.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32,
                       device=DEVICE), bt.to(DEVICE), block_size, scale, sliding_window=window,
                       num_splits=num_splits, out=out)
    # Reference: fp32 values of the same codes (the unwritten, poisoned slots are never read).
    ref_k = kv_quant.dequantize(kc.data, kc.scale.nan_to_num(), torch.float32).nan_to_num()
    ref_v = kv_quant.dequantize(vc.data, vc.scale.nan_to_num(), torch.float32).nan_to_num()
    plan = pa_ref.TorchAttentionPlan.build(query_lens, seq_lens, tables, block_size, window)
    ref = pa_ref.paged_attention(q.float(), ref_k, ref_v, plan, scale)
    out = out.cpu()
    assert not out.isnan().any(), "kernel left elements unwritten (NaN poison survived)"
    err = (out.float() - ref).abs().max().item()
    assert err <= ATTN_TOL[dtype] * ref.abs().max().item(), f"max|out-ref| = {err:.3g}"


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_reads_quantised_blocks(name, dtype, num_splits):
    _attention_case(name, [1, 1, 1], [1, 17, 141], kv_heads=2, group=4, dtype=dtype, num_splits=num_splits)


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_and_decode_mixed_read_quantised_blocks(name, dtype):
    _attention_case(name, [20, 1, 7], [20, 33, 90], kv_heads=2, group=2, dtype=dtype, seed=3)


def test_sliding_window_on_quantised_blocks():
    _attention_case("int8", [1, 30], [70, 100], kv_heads=1, group=4, window=37, num_splits=2, seed=4)
