"""The C decode step (tokenyard/kernels/cpu_decode_step.c via tokenyard/engines/model/native_decoder.py, knob cpu_decode_step).

Its logits and the K/V it writes must equal the eager forward's to fp32 rounding (atol 1e-4 on
logits of magnitude ~3: the sums run in another order) for every architecture feature the tests'
checkpoints cover (GQA and llama3 rope scaling, a sliding window, q/k/v biases with tied
embeddings), at batch 1 and above, for fp32, int8 and int4 weights (quantised ones against the
fp32 reference backend, which computes the same weights exactly), and on each vector path
(AVX-512, AVX2, plain x86-64) where the compiler can build it. Engines with the step on produce
the greedy tokens of engines without it; the knob's fallbacks and bad inputs are checked too.
"""
from __future__ import annotations

import logging
import platform

import pytest
import torch

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model import model_runner, native_decoder
from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.native_decoder import NativeDecoder, step_linear
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.kernels import cpu_decode_step
from tokenyard.kernels.cpu_decode_step import INT4_ROWS16, linear_slots
from tokenyard.kernels.quant_layout import dequantize_int4_weight, quantize_int4
from tokenyard.nativelib.build import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler: the C decode step cannot be built")

OPTIONS = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=128, max_num_seqs=8, block_size=8, progress=False,
               dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# int8-rounded inputs of quantised products (AVX2 and AVX-512 builds, small batches): the logits of these random
# test models (magnitude ~3) move by up to ~0.05 through their layers
INT8_INPUTS_ATOL = 0.15
# int4 in 16-row blocks (AVX-512 VNNI builds) keeps scales and minimums in fp16, 2^-11 relative: against the
# exact fp32 reference the logits of these test models moved by up to 0.005
FP16_SCALES_ATOL = 0.02


def _prefilled(engine: Engine, n: int, seed: int) -> list[Sequence]:
    """n sequences whose prompts are in the engine's cache (computed eagerly), one block spare."""
    bs = engine.config.block_size
    seqs = [Sequence(f"s{i}", p, GREEDY, 0, i, 0, frozenset())
            for i, p in enumerate(random_prompts(n, 5, 40, engine.model_config.vocab_size, seed=seed))]
    for s in seqs:
        p = s.token_ids
        engine.blocks.grow(s.block_table, len(p) + 1)
        slots = [s.block_table[t // bs] * bs + t % bs for t in range(len(p))]
        meta = AttentionMetadata.build(slots, [len(p)], [len(p)], [s.block_table], bs,
                                       engine.model_config.sliding_window, engine.device)
        engine.model(torch.tensor(p), torch.arange(len(p)), meta, engine.runner.kv_caches, torch.tensor([len(p) - 1]))
    return seqs


def _compare_step(engine: Engine, dec: NativeDecoder, n: int, seed: int, atol: float = 1e-4) -> None:
    """One decode token for n sequences through the C step and through the eager forward: same
    logits, same K/V in the cache. Quantised steps of fewer than 8 sequences on builds that round
    the products' inputs to int8 (AVX2; tests/kernels/test_cpu_matvec.py bounds each product) agree to
    INT8_INPUTS_ATOL instead."""
    if n < 8 and dec.step._lib.int8_inputs and any(isinstance(m, QuantLinear) for m in engine.model.modules()):
        atol = max(atol, INT8_INPUTS_ATOL)
    if any(getattr(obj, name).kind == INT4_ROWS16 for obj, name in linear_slots(dec.step.spec)):
        atol = max(atol, FP16_SCALES_ATOL)
    bs = engine.config.block_size
    seqs = _prefilled(engine, n, seed)
    try:
        ids = [s.token_ids[-1] for s in seqs]
        pos = [s.num_tokens for s in seqs]
        tables = [s.block_table for s in seqs]
        slots = [t[q // bs] * bs + q % bs for t, q in zip(tables, pos)]
        lens = [q + 1 for q in pos]
        got = dec.run(ids, pos, slots, lens, tables)
        written = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
        meta = AttentionMetadata.build(slots, [1] * n, lens, tables, bs, engine.model_config.sliding_window,
                                       engine.device)
        want = engine.model(torch.tensor(ids), torch.tensor(pos), meta, engine.runner.kv_caches, torch.arange(n))
        assert got.shape == want.shape == (n, engine.model_config.vocab_size)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        for (k0, v0), (k1, v1) in zip(written, engine.runner.kv_caches):
            torch.testing.assert_close(k0, k1, atol=atol, rtol=atol)
            torch.testing.assert_close(v0, v1, atol=atol, rtol=atol)
    finally:
        for s in seqs:
            engine.blocks.free(s)


def _engine(path, **kw) -> Engine:
    return Engine(path, cpu_decode_step="off", **{**OPTIONS, **kw})


def _decoder(engine: Engine, max_batch: int = 4, threads: int = 2) -> NativeDecoder:
    return NativeDecoder(engine.model, engine.runner.kv_caches, engine.config.block_size, 256, max_batch, threads)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_step_matches_the_eager_forward(checkpoint_dir, arch):
    engine = _engine(checkpoint_dir(arch))
    dec = _decoder(engine, max_batch=24)
    try:
        # 15: the dot-product tiles with their 1-token edges; 20: packed panels (cpu_matvec_panel.c)
        for n in (1, 3, 4, 15, 20):
            _compare_step(engine, dec, n, seed=n)
    finally:
        dec.close()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_weights_match_the_fp32_reference_backend(checkpoint_dir, monkeypatch, quant):
    # The reference backend dequantises the stored layout exactly in fp32, as the C step does; the
    # packed CPU ops round activations to bf16 (compared further down, weight by weight).
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "torch")
    engine = _engine(checkpoint_dir("qwen2" if quant == "int8" else "llama"), quantization=quant, quant_group_size=32)
    assert any(isinstance(m, QuantLinear) and m.backend == "torch" for m in engine.model.modules())
    dec = _decoder(engine, max_batch=24)
    try:
        for n in (1, 4, 15, 20):
            _compare_step(engine, dec, n, seed=10 + n)
    finally:
        dec.close()


@pytest.mark.parametrize("group", [32, 64])
def test_int4_taken_from_torchs_packed_cpu_layout_is_the_same_weight(group):
    g = torch.Generator().manual_seed(group)
    w = torch.randn(80, 128, generator=g)           # 80 rows: padded to 96 by the packed op
    layout = quantize_int4(w, group)
    expected = dequantize_int4_weight(layout)
    packed = QuantLinear(layout, backend="cpu")
    if packed.backend != "cpu" or packed._layout is None:
        pytest.skip("torch's packed int4 CPU op is unavailable or in an unknown layout")
    lin = step_linear(packed)
    codes = lin.w.reshape(80, 128 // 32, 16)
    q = torch.stack([codes & 0xF, codes >> 4], dim=2).reshape(80, 128).float()
    got = (q.reshape(80, 128 // group, group) * lin.scale[..., None] + lin.minv[..., None]).reshape(80, 128)
    # the packed op keeps scale and zero in bf16: the weight agrees to bf16 rounding of both
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector paths")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_every_vector_path_gives_the_same_logits(checkpoint_dir, monkeypatch, march):
    """-march=native picks one path on this machine; AVX2 (x86-64-v3) and plain SSE builds are
    the paths other machines take."""
    monkeypatch.setenv("TOKENYARD_NATIVE_MARCH", march)
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "torch")
    if cpu_decode_step.load() is None:
        pytest.skip(f"the compiler cannot build -march={march}")
    for path_kw in (dict(), dict(quantization="int4", quant_group_size=32), dict(quantization="int8")):
        engine = _engine(checkpoint_dir("qwen2"), **path_kw)
        dec = _decoder(engine, max_batch=20)
        try:
            _compare_step(engine, dec, 1, seed=7)
            _compare_step(engine, dec, 15, seed=8)
            _compare_step(engine, dec, 20, seed=9)
        finally:
            dec.close()


def test_thread_count_does_not_change_the_logits(checkpoint_dir):
    engine = _engine(checkpoint_dir("llama"))
    seqs = _prefilled(engine, 2, seed=4)
    bs = engine.config.block_size
    ids = [s.token_ids[-1] for s in seqs]
    pos = [s.num_tokens for s in seqs]
    tables = [s.block_table for s in seqs]
    slots = [t[q // bs] * bs + q % bs for t, q in zip(tables, pos)]
    outs = []
    for threads in (1, 2, 3):
        dec = _decoder(engine, threads=threads)
        outs.append(dec.run(ids, pos, slots, [q + 1 for q in pos], tables))
        dec.close()
    # each output row is one thread's sum in a fixed order: the split never changes a row's arithmetic
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_weights_move_to_the_arena_and_stay_shared(checkpoint_dir):
    engine = _engine(checkpoint_dir("qwen2"))          # tied embeddings
    model = engine.model
    dec = _decoder(engine)
    try:
        lo = dec.arena._bytes.data_ptr()
        hi = lo + dec.arena.capacity
        for name in ("embed_tokens.weight", "layers.0.qkv_proj.weight", "layers.1.down_proj.weight", "norm.weight"):
            ptr = model.get_parameter(name).data_ptr()
            assert lo <= ptr < hi, name
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        assert dec.step.spec.layers[0].qkv.w.data_ptr() == model.layers[0].qkv_proj.weight.data_ptr()
    finally:
        dec.close()


def test_engine_greedy_tokens_equal_with_the_step_on_and_off(checkpoint_dir):
    path = checkpoint_dir("llama")
    on = Engine(path, cpu_decode_step="on", cpu_decode_step_max_batch=3, **OPTIONS)
    off = Engine(path, cpu_decode_step="off", **OPTIONS)
    assert on.runner.native is not None and off.runner.native is None
    prompts = random_prompts(6, 2, 50, on.model_config.vocab_size, seed=21)
    for batch in ([prompts[0]], prompts[:3], prompts):       # all in the step, then some beyond its 3
        got = {}
        for engine in (on, off):
            for i, p in enumerate(batch):
                engine.add_request(f"r{i}", p, GREEDY)
            got[engine is on] = run_to_completion(engine)
        assert got[True] == got[False]
    assert on.runner.num_native_steps >= 2 * (GREEDY.max_tokens - 1)   # batches 1 and 3 (6 is beyond it)


def test_bad_steps_are_refused_before_anything_is_written(checkpoint_dir):
    engine = _engine(checkpoint_dir("llama"))
    dec = _decoder(engine, max_batch=2)
    caches = [(k.clone(), v.clone()) for k, v in engine.runner.kv_caches]
    slots_total = engine.runner.kv_caches[0][0].shape[1]
    vocab = engine.model_config.vocab_size
    try:
        with pytest.raises(ValueError, match="max_batch"):
            dec.run([1, 2, 3], [0, 0, 0], [0, 1, 2], [1, 1, 1], [[0], [1], [2]])
        for ids, slots, tables in (([vocab], [0], [[0]]), ([-1], [0], [[0]]), ([1], [slots_total], [[0]]),
                                   ([1], [0], [[10**6]])):
            with pytest.raises(ValueError, match="outside"):
                dec.run(ids, [0], slots, [1], tables)
        for (k0, v0), (k1, v1) in zip(caches, engine.runner.kv_caches):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
        dec.close()
        with pytest.raises(RuntimeError, match="closed"):
            dec.run([1], [0], [0], [1], [[0]])
    finally:
        dec.close()


# -- the knob -------------------------------------------------------------------------------------

def test_knob_values_are_checked(checkpoint_dir):
    path = checkpoint_dir("llama")
    with pytest.raises(ValueError, match="cpu_decode_step must be"):
        Engine(path, cpu_decode_step="yes", **OPTIONS)
    for bad in (-1, 257, True):
        with pytest.raises(ValueError, match="cpu_decode_step_max_batch"):
            Engine(path, cpu_decode_step_max_batch=bad, **OPTIONS)


def test_auto_uses_the_size_rule_and_the_environment_overrides(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("llama")
    monkeypatch.delenv("TOKENYARD_CPU_DECODE_STEP", raising=False)
    assert Engine(path, **OPTIONS).runner.native is None                    # auto, a test-sized model
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    engine = Engine(path, **OPTIONS)
    # auto: every batch the engine schedules (max_num_seqs 8 here) without the compiled graph
    assert engine.runner.native is not None and engine.runner.native.max_batch == 8
    assert Engine(path, cpu_decode_step_max_batch=3, **OPTIONS).runner.native.max_batch == 3
    # beside the compiled graph (compiling skipped here) auto keeps 1..16, where the C step is faster
    monkeypatch.setattr(model_runner.CompiledDecoder, "warm_up", lambda self: 0.0)
    both = Engine(path, cpu_compile="on", **{**OPTIONS, "max_num_seqs": 40}).runner
    assert both.native.max_batch == 16 and both.compiled is not None
    # ... without a compiled graph (cpu_compile off) it takes every batch, 40 here
    alone = Engine(path, cpu_compile="off", **{**OPTIONS, "max_num_seqs": 40}).runner
    assert alone.native.max_batch == 40 and alone.compiled is None
    # ... and when the C step takes every batch the engine schedules, nothing is compiled: auto up to
    # 16 sequences, or a max_batch that covers max_num_seqs
    assert Engine(path, cpu_compile="on", **OPTIONS).runner.compiled is None
    assert Engine(path, cpu_compile="on", cpu_decode_step_max_batch=40,
                  **{**OPTIONS, "max_num_seqs": 40}).runner.compiled is None
    monkeypatch.setenv("TOKENYARD_CPU_DECODE_STEP", "off")
    assert Engine(path, **OPTIONS).runner.native is None
    assert Engine(path, cpu_decode_step="on", **OPTIONS).runner.native is not None   # the knob wins


def test_models_the_step_cannot_run_fall_back_under_auto_and_raise_under_on(checkpoint_dir, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    path = checkpoint_dir("llama")
    bf16 = dict(OPTIONS, dtype="bfloat16")
    assert Engine(path, cpu_decode_step="auto", **bf16).runner.native is None
    with pytest.raises(ValueError, match="bfloat16"):
        Engine(path, cpu_decode_step="on", **bf16)
    int8_kv = dict(OPTIONS, kv_cache_dtype="int8")
    assert Engine(path, cpu_decode_step="auto", **int8_kv).runner.native is None
    with pytest.raises(ValueError, match="KV cache"):
        Engine(path, cpu_decode_step="on", **int8_kv)
    # no compiler (or a failed build): a warning under auto, an error under on; the engine still serves
    monkeypatch.setattr(native_decoder.cpu_decode_step, "load", lambda int8_inputs=True: None)
    with caplog.at_level(logging.WARNING, logger="tokenyard.engines.model.model_runner"):
        engine = Engine(path, cpu_decode_step="auto", **OPTIONS)
    assert engine.runner.native is None and "unavailable" in caplog.text
    engine.add_request("x", random_prompts(1, 4, 4, 100)[0], SamplingParams(temperature=0.0, max_tokens=3))
    assert len(run_to_completion(engine)["x"]) == 3
    with pytest.raises(RuntimeError, match="unavailable"):
        Engine(path, cpu_decode_step="on", **OPTIONS)


def test_spin_limit_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("TOKENYARD_STEP_SPIN", raising=False)
    assert cpu_decode_step.default_spin_limit() == cpu_decode_step.DEFAULT_SPIN_LIMIT
    monkeypatch.setenv("TOKENYARD_STEP_SPIN", " 2000 ")
    assert cpu_decode_step.default_spin_limit() == 2000
    for bad in ("0", "-5", "fast", "1e4"):
        monkeypatch.setenv("TOKENYARD_STEP_SPIN", bad)
        with pytest.raises(ValueError, match="TOKENYARD_STEP_SPIN"):
            cpu_decode_step.default_spin_limit()


def test_workers_that_sleep_between_steps_give_the_same_tokens(checkpoint_dir, monkeypatch):
    """Spin limit 1: the pool's worker sleeps after every step and must be woken for the next."""
    path = checkpoint_dir("llama")
    prompts = random_prompts(3, 2, 30, Engine(path, cpu_decode_step="off", **OPTIONS).model_config.vocab_size, seed=5)
    got = {}
    for spin in ("200000", "1"):
        monkeypatch.setenv("TOKENYARD_STEP_SPIN", spin)
        engine = Engine(path, cpu_decode_step="on", **OPTIONS)
        assert engine.runner.native is not None
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, GREEDY)
        got[spin] = run_to_completion(engine)
    assert got["1"] == got["200000"] and all(len(t) == GREEDY.max_tokens for t in got["1"].values())
