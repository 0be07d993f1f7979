"""Decode-group attention on CPU (tokenyard/kernels/decode_group_torch.py): every form, over fp32 and
quantised caches, against a dense reference written here (dequantise the whole cache, then per
sequence and head softmax(q . K^T * scale + mask) . V with the GQA head mapping spelled out).

The quantised forms fold the per-(token, kv head) scales into scores and probabilities; the
reference multiplies them into K and V. Both are fp32 over the same codes, so they differ only by
rounding and summation order: atol 2e-5 on outputs of magnitude ~0.1-1 (values ~N(0, 1)); a
folding mistake (a scale applied twice, or to the wrong key) is off by O(0.1)."""
from __future__ import annotations

import pytest
import torch

from tokenyard.kernels import cpu_decode_native
from tokenyard.kernels import decode_group_torch as dg
from tokenyard.kernels import paged_attention_torch as pa
from tokenyard.kernels.kv_quant import QuantizedCache, dequantize, quantize

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 16, 16
ATOL = 2e-5


def _caches(num_blocks: int, dtype: torch.dtype | None, seed: int):
    """(k_cache, v_cache, k_values, v_values): the values are what a reader must see."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, num_blocks * BLOCK, HEAD_DIM, generator=g)
    v = torch.randn(KV_HEADS, num_blocks * BLOCK, HEAD_DIM, generator=g)
    if dtype is None:
        return k, v, k, v
    kq, vq = QuantizedCache(*quantize(k, dtype)), QuantizedCache(*quantize(v, dtype))
    return kq, vq, dequantize(kq.data, kq.scale, torch.float32), dequantize(vq.data, vq.scale, torch.float32)


def _reference(q, kf, vf, query_lens, seq_lens, tables, scale, window):
    out = torch.empty_like(q)
    start = 0
    for n, length, table in zip(query_lens, seq_lens, tables):
        pos = torch.arange(length)
        slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
        for r in range(n):
            q_pos = length - n + r
            seen = pos <= q_pos
            if window is not None:
                seen &= pos > q_pos - window
            for h in range(HEADS):
                kvh = h // (HEADS // KV_HEADS)
                k, v = kf[kvh, slots][seen], vf[kvh, slots][seen]
                w = torch.softmax(q[start + r, h] @ k.T * scale, dim=-1)
                out[start + r, h] = w @ v
        start += n
    return out


def _case(seq_lens, query_lens):
    need = [-(-n // BLOCK) for n in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for m in need:
        tables.append(perm[at:at + m])
        at += m
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    return tables, sum(need) + 3, q


# Mixed lengths in several length buckets (short ones, and 1,100-2,049 keys: both sides of the
# per-sequence threshold); query lengths 1 (decode) and 3 (a speculative verify chunk) make
# separate decode groups; a sliding window or none.
@pytest.mark.parametrize("dtype", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("seq_lens", [[7, 100, 33, 64, 17, 250, 90, 5, 300, 280, 41, 120],
                                      [1100, 1500, 37, 2049, 900]])
def test_every_decode_form_matches_the_dense_reference(dtype, window, seq_lens):
    query_lens = [3 if i % 3 == 1 else 1 for i in range(len(seq_lens))]
    tables, num_blocks, q = _case(seq_lens, query_lens)
    kc, vc, kf, vf = _caches(num_blocks, dtype, seed=len(seq_lens))
    scale = HEAD_DIM ** -0.5
    want = _reference(q, kf, vf, query_lens, seq_lens, tables, scale, window)
    assert want.abs().max() > 0.05      # not a degenerate output

    def build() -> pa.TorchAttentionPlan:
        return pa.TorchAttentionPlan.build(query_lens, seq_lens, tables, BLOCK, sliding_window=window)

    assert not build().chunks and len(build().decode_groups) >= 2
    torch.testing.assert_close(pa.paged_attention(q, kc, vc, build(), scale), want, atol=ATOL, rtol=0)
    native = cpu_decode_native.load()
    for form in dg.FORMS:
        if form == "native" and (native is None or dtype == torch.float8_e4m3fn):
            continue        # the C kernel takes fp32 and int8 caches (tests/kernels/test_cpu_decode_native.py)
        plan = build()
        got = torch.empty_like(q)
        for g in plan.decode_groups:
            got[g.rows] = dg.attend_group(q, kc, vc, g, scale, form=form)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m, f=form: f"form {f}: {m}")
        # Every layer of a step reuses the plan (gather indices, scratch buffer): a second call on
        # another layer's cache must not see the first one's values.
        kc2, vc2, kf2, vf2 = _caches(num_blocks, dtype, seed=99)
        want2 = _reference(q, kf2, vf2, query_lens, seq_lens, tables, scale, window)
        for g in plan.decode_groups:
            got[g.rows] = dg.attend_group(q, kc2, vc2, g, scale, form=form)
        torch.testing.assert_close(got, want2, atol=ATOL, rtol=0, msg=lambda m, f=form: f"form {f}, 2nd layer: {m}")


def test_forms_are_chosen_by_context_length_and_cache_kind():
    assert dg.choose_form(False, 1, 4096) == dg.choose_form(True, 4, 4096) == "per_sequence"
    assert dg.choose_form(False, 1, 64) == dg.choose_form(False, 32, 512) == "sdpa"
    assert dg.choose_form(True, 1, 64) == "sdpa"          # too few keys for the folded ops to pay
    assert dg.choose_form(True, 8, 512) == "batched"
    with pytest.raises(ValueError, match="unknown decode attention form"):
        plan = pa.TorchAttentionPlan.build([1], [5], [[0]], BLOCK)
        kc, vc, _, _ = _caches(1, None, seed=0)
        dg.attend_group(torch.zeros(1, HEADS, HEAD_DIM), kc, vc, plan.decode_groups[0], 0.25, form="nope")


def test_long_groups_reuse_one_scratch_buffer_per_step(monkeypatch):
    monkeypatch.setenv("TOKENYARD_CPU_ATTENTION", "torch")      # the torch forms' buffer
    plan = pa.TorchAttentionPlan.build([1, 1], [2049, 1500], [list(range(129)), list(range(129, 223))], BLOCK)
    kq, vq, _, _ = _caches(223, torch.int8, seed=0)
    q = torch.randn(2, HEADS, HEAD_DIM)
    pa.paged_attention(q, kq, vq, plan, HEAD_DIM ** -0.5)
    scratch = plan.decode_groups[0].scratch
    assert scratch is not None and scratch.shape == (2, KV_HEADS * 129, BLOCK * HEAD_DIM)
    pa.paged_attention(q, kq, vq, plan, HEAD_DIM ** -0.5)   # the next layer
    assert plan.decode_groups[0].scratch is scratch
