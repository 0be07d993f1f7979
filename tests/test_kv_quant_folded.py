"""The quantised-cache decode path of kernels/paged_attention_torch.py folds the per-(token, kv
head) scales into the scores and probabilities instead of dequantising the gathered tiles.
Checked against the reference it replaces: dequantise the whole cache (codes * scale, fp32), then
the plain fp32 paged attention over the same plan. Both are fp32 over the same codes, so they
differ only by summation order: atol 1e-4 on O(1) outputs (values ~N(0, 1))."""
from __future__ import annotations

import pytest
import torch

from kernels import paged_attention_torch as pa
from kernels.kv_quant import QuantizedCache, dequantize, quantize

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 16, 16


def _caches(num_blocks: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(KV_HEADS, num_blocks * BLOCK, HEAD_DIM, generator=g)
    v = torch.randn(KV_HEADS, num_blocks * BLOCK, HEAD_DIM, generator=g)
    kq, vq = QuantizedCache(*quantize(k, dtype)), QuantizedCache(*quantize(v, dtype))
    return kq, vq, dequantize(kq.data, kq.scale, torch.float32), dequantize(vq.data, vq.scale, torch.float32)


# Lengths span both sides of the folding threshold (2048 gathered keys) and of the per-sequence
# one (1024 keys), in several length buckets;
# query lengths 1 (decode) and 3 (a speculative verify chunk) make separate decode groups.
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("seq_lens", [[7, 100, 33, 64, 17, 250, 90, 5, 300, 280, 41, 120],
                                      [1100, 1500, 37, 2049, 900]])
def test_folded_decode_matches_dequantised_reference(dtype, window, seq_lens):
    query_lens = [3 if i % 3 == 1 else 1 for i in range(len(seq_lens))]
    need = [-(-n // BLOCK) for n in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=torch.Generator().manual_seed(1)).tolist()
    tables, at = [], 0
    for m in need:
        tables.append(perm[at:at + m])
        at += m
    kq, vq, kf, vf = _caches(sum(need) + 3, dtype, seed=len(seq_lens))
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    scale = HEAD_DIM ** -0.5

    def build() -> pa.TorchAttentionPlan:
        return pa.TorchAttentionPlan.build(query_lens, seq_lens, tables, BLOCK, sliding_window=window)

    plan = build()
    assert not plan.chunks and len(plan.decode_groups) >= 2
    # Some group of each case is big enough for the folded path (smaller ones dequantise).
    assert any(g.blocks.numel() * BLOCK >= pa._FOLD_KEYS for g in plan.decode_groups)
    got = pa.paged_attention(q, kq, vq, plan, scale)
    want = pa.paged_attention(q, kf, vf, build(), scale)
    assert got.abs().max() > 0.05      # not a degenerate output
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # Every layer of a step reuses the plan (gather indices, scratch buffer): a second call on a
    # different cache must not see the first one's values.
    kq2, vq2, kf2, vf2 = _caches(sum(need) + 3, dtype, seed=99)
    torch.testing.assert_close(pa.paged_attention(q, kq2, vq2, plan, scale),
                               pa.paged_attention(q, kf2, vf2, build(), scale), atol=1e-4, rtol=0)


def test_long_groups_take_the_per_sequence_path():
    """The 2049-key case above must exercise the reused-buffer branch, not only the batched one."""
    plan = pa.TorchAttentionPlan.build([1, 1], [2049, 1500], [list(range(129)), list(range(129, 223))], BLOCK)
    kq, vq, _, _ = _caches(223, torch.int8, seed=0)
    q = torch.randn(2, HEADS, HEAD_DIM)
    pa.paged_attention(q, kq, vq, plan, HEAD_DIM ** -0.5)
    assert plan.decode_groups[0].scratch is not None
    assert plan.decode_groups[0].blocks.shape[1] * BLOCK >= pa._PER_SEQUENCE_KEYS
