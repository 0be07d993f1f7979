"""Quantised KV cache (EngineConfig.kv_cache_dtype int8 / fp8_e4m3; tokenyard/kernels/kv_quant.py).

Error bounds of one stored value x of a (token, kv head) row with scale s = max|x| / QMAX:
int8 stores round(x / s), so |x - x'| <= s / 2 (plus fp32 rounding of the division and the
product, ~1e-6 relative, covered by a 1e-5 slack); e4m3 keeps 3 mantissa bits, so a normal code
is within 2^-4 of its value relative and a subnormal one (below 2^-6) within 2^-10 absolute:
|x - x'| <= max(|x| / 16, s * 2^-10) (same slack).

Engine tests here check exact equalities where quantisation cannot matter, under one
kv_cache_dtype: a cached prefix block against recomputing it, preemption and abort against
neither. tests/engines/test_kv_quant_engine.py has the agreement with unquantised caches, speculation,
tensor parallelism and the compiled and CUDA-graph decode paths.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.model.kv_cache import bytes_per_block
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.kernels import kv_quant
from tokenyard.kernels import paged_attention_torch as torch_path

ROOT = Path(__file__).resolve().parents[2]
DEMO_SMALL, DEMO_LARGE = ROOT / "models" / "demo-small", ROOT / "models" / "demo-large"
QUANT = ("int8", "fp8_e4m3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    s = scale[..., None]
    if dtype == torch.int8:
        b = s / 2
    else:
        b = torch.maximum(x.abs() / 16, s * 2.0 ** -10)
    return b + 1e-5 * x.abs().amax(-1, keepdim=True)


@pytest.mark.parametrize("name", QUANT)
def test_quantize_round_trip_within_bound(name):
    dtype = kv_quant.STORAGE_DTYPES[name]
    g = torch.Generator().manual_seed(0)
    # Rows of very different magnitudes, an outlier channel, and an all-zero row.
    x = torch.randn(64, 3, 32, generator=g) * torch.logspace(-3, 2, 64)[:, None, None]
    x[:, :, 5] *= 20
    x[7, 1] = 0
    codes, scale = kv_quant.quantize(x, dtype)
    assert codes.dtype == dtype and scale.shape == (64, 3) and scale.dtype == torch.float32
    back = kv_quant.dequantize(codes, scale, torch.float32)
    assert (back - x).abs().le(_bound(x, scale, dtype)).all()
    assert torch.equal(back[7, 1], torch.zeros(32))
    # The largest value of each (non-zero) row is stored at the top code: the range is all used.
    top = codes.float().abs().amax(-1)
    assert top[7, 1] == 0 and top.flatten()[top.flatten() > 0].eq(kv_quant.QMAX[dtype]).all()


@pytest.mark.parametrize("name", QUANT)
def test_blocks_written_then_read_back_within_bound(name):
    """write_kv into a quantised cache at scattered slots; the attention gathers read back values
    within the bound, scales sit beside their slots, and no other slot changes."""
    dtype = kv_quant.STORAGE_DTYPES[name]
    g = torch.Generator().manual_seed(1)
    kvh, slots_n, hd, t = 2, 64, 16, 20
    kc = kv_quant.allocate(kvh, slots_n, hd, dtype, torch.device("cpu"))
    vc = kv_quant.allocate(kvh, slots_n, hd, dtype, torch.device("cpu"))
    k, v = torch.randn(t, kvh, hd, generator=g) * 3, torch.randn(t, kvh, hd, generator=g)
    slots = torch.randperm(slots_n, generator=g)[:t]
    torch_path.write_kv(kc, vc, k, v, slots)
    for cache, x in ((kc, k), (vc, v)):
        rows = x.transpose(0, 1)                                            # [kvh, t, hd]
        back = kv_quant.dequantize(cache.data[:, slots], cache.scale[:, slots], torch.float32)
        assert (back - rows).abs().le(_bound(rows, cache.scale[:, slots], dtype)).all()
        assert torch.allclose(cache.scale[:, slots], rows.abs().amax(-1) / kv_quant.QMAX[dtype])
        untouched = torch.ones(slots_n, dtype=torch.bool)
        untouched[slots] = False
        assert cache.data[:, untouched].float().eq(0).all() and cache.scale[:, untouched].eq(1).all()


@pytest.mark.parametrize("name", QUANT)
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 40, 1]])
def test_torch_attention_on_quantised_blocks_equals_attention_on_their_values(name, query_lens):
    """The torch path reads a quantised cache exactly as it reads a float cache holding the
    dequantised values (decode groups, long chunks and the compiled-decode form)."""
    dtype = kv_quant.STORAGE_DTYPES[name]
    g = torch.Generator().manual_seed(2)
    kvh, heads, hd, bs = 2, 4, 16, 4
    seq_lens = [9, 45, 23]
    tables = [[7, 2, 11], list(range(12, 24)), [3, 0, 1, 4, 5, 6]]
    slots_n = 24 * bs
    qc = (kv_quant.allocate(kvh, slots_n, hd, dtype, torch.device("cpu")),
          kv_quant.allocate(kvh, slots_n, hd, dtype, torch.device("cpu")))
    fc = (torch.zeros(kvh, slots_n, hd), torch.zeros(kvh, slots_n, hd))
    for table, n in zip(tables, seq_lens):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        k, v = torch.randn(n, kvh, hd, generator=g), torch.randn(n, kvh, hd, generator=g)
        torch_path.write_kv(*qc, k, v, slots)
    for f, q in zip(fc, qc):
        f.copy_(kv_quant.dequantize(q.data, q.scale, torch.float32))
    q = torch.randn(sum(query_lens), heads, hd, generator=g)
    got = torch_path.paged_attention(q, *qc, torch_path.TorchAttentionPlan.build(query_lens, seq_lens, tables, bs), 0.25)
    want = torch_path.paged_attention(q, *fc, torch_path.TorchAttentionPlan.build(query_lens, seq_lens, tables, bs), 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if query_lens == [1, 1, 1]:
        width = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        got = torch_path.decode_attention(q, *qc, bt, torch.tensor(seq_lens), bs, 0.25)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# -- configuration and the byte budget --------------------------------------------------------

def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(DEMO_SMALL, kv_cache_dtype="fp8", progress=False)


def test_a_device_that_cannot_store_the_dtype_fails_at_start_up(monkeypatch):
    # The meta device allocates nothing: its values cannot be read back.
    with pytest.raises(ValueError, match="kv_cache_dtype int8 cannot be stored on device meta"):
        kv_quant.check_device("int8", torch.device("meta"))

    def no_fp8(x, dtype):
        raise RuntimeError('"index_put" not implemented for Float8_e4m3fn')
    monkeypatch.setattr(kv_quant, "quantize", no_fp8)
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e4m3 cannot be stored on device cpu: .*Float8"):
        Engine(DEMO_SMALL, kv_cache_dtype="fp8_e4m3", kv_cache_memory=4 << 20, progress=False)
    kv_quant.check_device("auto", torch.device("meta"))   # auto stores the model's dtype: nothing to check


@pytest.mark.parametrize("model_dtype, ratio", [("float32", 128 / 36), ("bfloat16", 64 / 36)])
def test_blocks_follow_the_byte_budget_and_stats_report_bytes_per_block(model_dtype, ratio):
    """demo-small: 4 layers, 2 kv heads, head_dim 32. A token of one head costs 32 x 4 bytes in
    fp32, 32 x 2 in bf16 and 32 + 4 (codes + fp32 scale) quantised."""
    mem = 8 << 20
    stats = {}
    for kv in ("auto", *QUANT):
        eng = Engine(DEMO_SMALL, dtype=model_dtype, kv_cache_dtype=kv, kv_cache_memory=mem, progress=False)
        stats[kv] = eng.stats()
        cfg = ModelConfig.from_dir(DEMO_SMALL)
        assert stats[kv].kv_bytes_per_block == bytes_per_block(cfg, 16, getattr(torch, model_dtype), kv)
        assert stats[kv].num_total_blocks == mem // stats[kv].kv_bytes_per_block
        # What was allocated is what the stats claim.
        held = sum(t.data.nbytes + t.scale.nbytes if isinstance(t, kv_quant.QuantizedCache) else t.nbytes
                   for layer in eng.runner.kv_caches for t in layer)
        assert held == stats[kv].num_total_blocks * stats[kv].kv_bytes_per_block
    assert stats["auto"].kv_cache_dtype == model_dtype and stats["int8"].kv_cache_dtype == "int8"
    assert stats["int8"].kv_bytes_per_block == 2 * 4 * 16 * 2 * (32 + 4)
    for kv in QUANT:
        assert stats[kv].num_total_blocks / stats["auto"].num_total_blocks == pytest.approx(ratio, rel=0.01)


def test_gateway_metric_reports_bytes_per_block():
    from tokenyard.gateway.observability.metrics import GatewayMetrics

    class _Eng:   # the backend surface the collector reads
        num_failed_steps = 0

        def __init__(self, stats):
            self._s = stats

        def stats(self):
            return self._s

    eng = Engine(DEMO_SMALL, kv_cache_dtype="int8", kv_cache_memory=4 << 20, progress=False)
    text = GatewayMetrics(lambda: {"demo": _Eng(eng.stats())}).render().decode()
    assert f'tokenyard_engine_kv_bytes_per_block{{dtype="int8",engine="demo"}} {float(eng.kv_bytes_per_block)}' in text


# -- the engine on quantised blocks -----------------------------------------------------------

@pytest.mark.parametrize("kv", QUANT)
def test_prefix_cache_hit_gives_the_token_of_recomputing(kv):
    """A cached quantised block (codes and scales) read by a later request gives the same next
    token and logprob as an engine that recomputes the prefix."""
    prompt = random_prompts(1, 70, 70, 1962, seed=3)[0]      # 4 full blocks + 6 tokens
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = {}
    for caching in (True, False):
        eng = Engine(DEMO_SMALL, kv_cache_dtype=kv, kv_cache_memory=4 << 20, enable_prefix_caching=caching,
                     progress=False)
        eng.add_request("first", prompt, params)
        run_to_completion(eng)
        eng.add_request("second", prompt[:-3] + [17, 18, 19], params)
        steps = []
        while eng.has_unfinished():
            steps += [o for o in eng.step() if o.request_id == "second"]
        outs[caching] = steps
        if caching:
            assert eng.stats().prefix_cache_hit_tokens == 64
    toks = {c: [t for o in outs[c] for t in o.new_token_ids] for c in outs}
    assert toks[True] == toks[False]
    lp = {c: [lp[1] for o in outs[c] for lp in o.logprobs] for c in outs}
    assert lp[True] == pytest.approx(lp[False], abs=1e-4)


@pytest.mark.parametrize("kv", QUANT)
def test_preemption_and_abort_under_quantised_kv(kv):
    """A cache too small for every sequence preempts (recompute) and an abort frees blocks
    mid-decode; the survivors' tokens equal those of a cache large enough for all."""
    prompts = random_prompts(6, 20, 40, 1962, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for mem in (16 << 20, 160_000):
        eng = Engine(DEMO_SMALL, kv_cache_dtype=kv, kv_cache_memory=mem, max_num_batched_tokens=64,
                     enable_prefix_caching=False, progress=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        for _ in range(3):
            eng.step()
        eng.abort("r2")
        outs[mem] = run_to_completion(eng)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        if mem == 160_000:
            assert eng.stats().num_preemptions > 0
    for rid in (f"r{i}" for i in range(6) if i != 2):
        assert outs[160_000][rid] == outs[16 << 20][rid]
