"""Eager fp32 linears on oneDNN's packed weights (tokenyard/engines/model/onednn_linear.py, knob cpu_onednn_linear):
the same products as F.linear to fp32 rounding, only plain fp32 layers packed, parameters shared, and
the engine's greedy tokens unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.model import model_runner, onednn_linear

pytestmark = pytest.mark.skipif(not onednn_linear.available(), reason="this torch build has no oneDNN linear ops")

OPTIONS = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=64, max_num_seqs=8, block_size=8, progress=False,
               dtype="float32", cpu_decode_step="off")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_equals_f_linear_to_fp32_rounding(rows, bias):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    packed = onednn_linear.OneDNNLinear(lin, rows_hint=64)
    x = torch.randn(rows, 96, generator=g)
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    with torch.inference_mode():
        got = packed(x)
    # sums of 96 products of N(0,1) values (magnitude ~10): fp32 rounding in any order stays well under 1e-3
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-3)
    with torch.inference_mode():   # a batch of sequences (3-D input) keeps F.linear's shape
        assert packed(x.reshape(1, rows, 96)).shape == (1, rows, 200)


def test_only_plain_fp32_cpu_linears_are_packed_and_parameters_are_shared():
    class Sub(nn.Linear):     # stands for a quantised or otherwise special layer
        pass

    model = nn.Sequential(nn.Linear(8, 8), Sub(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Sequential(nn.Linear(8, 4)))
    weights = [model[0].weight, model[3][0].weight]
    assert onednn_linear.pack_linears(model) == 2
    assert isinstance(model[0], onednn_linear.OneDNNLinear) and isinstance(model[3][0], onednn_linear.OneDNNLinear)
    assert type(model[1]) is Sub and type(model[2]) is nn.Linear
    assert model[0].weight is weights[0] and model[3][0].weight is weights[1]
    assert onednn_linear.packed_bytes(model) == (64 + 32) * 4
    assert onednn_linear.pack_linears(model) == 0          # packing twice changes nothing


def test_engine_tokens_are_the_same_with_packed_linears(checkpoint_dir):
    path = checkpoint_dir("llama")
    on = Engine(path, cpu_onednn_linear="on", **OPTIONS)
    off = Engine(path, cpu_onednn_linear="off", **OPTIONS)
    assert on.runner.num_onednn_linears > 0 and off.runner.num_onednn_linears == 0
    assert isinstance(on.model.lm_head, onednn_linear.OneDNNLinear)
    prompts = random_prompts(4, 3, 60, on.model_config.vocab_size, seed=3)
    got = {}
    for engine in (on, off):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, GREEDY)
        got[engine is on] = run_to_completion(engine)
    assert got[True] == got[False] and all(len(t) == GREEDY.max_tokens for t in got[True].values())


def test_auto_packs_only_large_models_and_only_where_the_measurement_says_so(checkpoint_dir, monkeypatch):
    path = checkpoint_dir("llama")
    monkeypatch.delenv("TOKENYARD_CPU_ONEDNN_LINEAR", raising=False)
    assert Engine(path, **OPTIONS).runner.num_onednn_linears == 0        # a test model: below the size rule
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    for speedup, packs in ((1.0, False), (model_runner.ONEDNN_MIN_SPEEDUP + 0.5, True)):
        monkeypatch.setattr(onednn_linear, "measured_speedup", lambda *a, s=speedup, **k: s)
        runner = Engine(path, **OPTIONS).runner
        assert runner.cpu_onednn_linear_mode == "auto" and runner.onednn_speedup == speedup
        assert (runner.num_onednn_linears > 0) is packs
    # A quantised decoder whose only fp32 layer is the LM head (as when a GGUF's tied embedding stays fp32):
    # auto leaves it alone, "on" packs it.
    quantised = Engine(path, quantization="int8", **{**OPTIONS, "cpu_onednn_linear": "off"}).runner
    head = quantised.model.lm_head
    quantised.model.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)
    quantised._pack_linears("auto")
    assert quantised.num_onednn_linears == 0 and quantised.onednn_speedup is None
    quantised._pack_linears("on")
    assert quantised.num_onednn_linears == 1 and isinstance(quantised.model.lm_head, onednn_linear.OneDNNLinear)
    monkeypatch.setenv("TOKENYARD_CPU_ONEDNN_LINEAR", "off")    # the environment replaces auto
    runner = Engine(path, **OPTIONS).runner
    assert runner.cpu_onednn_linear_mode == "off" and runner.num_onednn_linears == 0


def test_the_measurement_is_a_positive_ratio():
    assert onednn_linear.measured_speedup(64, 128, 32, repeats=2) > 0


def test_bad_knob_values_are_refused(checkpoint_dir):
    with pytest.raises(ValueError, match="cpu_onednn_linear"):
        Engine(checkpoint_dir("llama"), cpu_onednn_linear="fast", **OPTIONS)
