"""The activation_quant knob (EngineConfig): whether the C decode step rounds the inputs of int8 and int4
products to int8 for small batches (cpu_matvec_q8.c), or keeps them fp32 (the -DTY_Q8_INPUTS=0 build).

"off" must give the eager fp32 forward's logits to fp32 rounding for quantised weights at every batch
(the same check as test_native_decode's fp32 models; with int8 inputs they move by up to ~0.05 on these
models, so the tight tolerance fails if the rounding is still on); "on" must be refused where it cannot
happen; the runner says which it is."""
from __future__ import annotations

import pytest

from tests.engines.test_native_decode import OPTIONS, _compare_step, _prefilled
from tokenyard.engines import Engine
from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.model.native_decoder import NativeDecoder
from tokenyard.kernels import cpu_decode_step
from tokenyard.nativelib.build import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler: the C decode step cannot be built")


def _int8_build() -> bool:
    lib = cpu_decode_step.load()
    return lib is not None and lib.int8_inputs


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_off_keeps_fp32_inputs_at_every_batch(checkpoint_dir, monkeypatch, quant):
    # The reference backend dequantises exactly in fp32, as the C step does with fp32 inputs.
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "torch")
    engine = Engine(checkpoint_dir("llama"), cpu_decode_step="off", quantization=quant, quant_group_size=32,
                    **OPTIONS)
    dec = NativeDecoder(engine.model, engine.runner.kv_caches, engine.config.block_size, 256, 8, 2,
                        int8_inputs=False)
    try:
        assert dec.quantised and not dec.int8_inputs and not dec.step._lib.int8_inputs
        for n in (1, 3, 7):
            _compare_step(engine, dec, n, seed=40 + n, atol=1e-4)
    finally:
        dec.close()
        engine.close()


def test_the_two_builds_differ_where_int8_inputs_exist(checkpoint_dir):
    """Where the machine has AVX2 the default build's logits move off the fp32 build's by more than
    fp32 rounding (so the test above would fail with it)."""
    if not _int8_build():
        pytest.skip("this build keeps fp32 inputs anyway (no AVX2)")
    engine = Engine(checkpoint_dir("llama"), cpu_decode_step="off", quantization="int8", **OPTIONS)
    decs = [NativeDecoder(engine.model, engine.runner.kv_caches, engine.config.block_size, 256, 4, 2,
                          int8_inputs=flag) for flag in (True, False)]
    seqs = _prefilled(engine, 2, seed=5)
    try:
        assert [d.int8_inputs for d in decs] == [True, False]
        bs = engine.config.block_size
        ids, pos = [s.token_ids[-1] for s in seqs], [s.num_tokens for s in seqs]
        tables = [s.block_table for s in seqs]
        slots = [t[q // bs] * bs + q % bs for t, q in zip(tables, pos)]
        a, b = (d.run(ids, pos, slots, [q + 1 for q in pos], tables) for d in decs)
        assert (a - b).abs().max() > 1e-3
    finally:
        for s in seqs:
            engine.blocks.free(s)
        for d in decs:
            d.close()
        engine.close()


@pytest.mark.parametrize("knob, want", [("auto", "int8"), ("on", "int8"), ("off", "fp32")])
def test_the_runner_reports_what_it_runs(checkpoint_dir, knob, want):
    if want == "int8" and not _int8_build():
        want = "fp32" if knob == "auto" else "error"
    kw = dict(cpu_decode_step="on", quantization="int8", activation_quant=knob, **OPTIONS)
    if want == "error":
        with pytest.raises(ValueError, match="no int8-input products"):
            Engine(checkpoint_dir("llama"), **kw)
        return
    engine = Engine(checkpoint_dir("llama"), **kw)
    try:
        assert engine.runner.native is not None and engine.runner.activation_quant == want
    finally:
        engine.close()


def test_on_where_it_cannot_happen_is_an_error(checkpoint_dir):
    # a float model: nothing to round
    with pytest.raises(ValueError, match="no int8 or int4 projections"):
        Engine(checkpoint_dir("llama"), cpu_decode_step="on", activation_quant="on", **OPTIONS)
    # auto leaves these small test models in torch (the 20M-parameter rule)
    with pytest.raises(ValueError, match="the C decode step does not run here"):
        Engine(checkpoint_dir("llama"), quantization="int8", activation_quant="on", **OPTIONS)
    # without the C step the float model reports nothing
    engine = Engine(checkpoint_dir("llama"), cpu_decode_step="off", **OPTIONS)
    try:
        assert engine.runner.activation_quant == "n/a"
    finally:
        engine.close()


@pytest.mark.parametrize("options, match", [
    (dict(activation_quant="yes"), "activation_quant must be auto, on or off"),
    (dict(activation_quant="on", cpu_decode_step="off"), "needs the C decode step"),
    (dict(activation_quant="on", tensor_parallel_size=2), "needs the C decode step"),
])
def test_bad_values_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_options(options)
