"""int8/int4 weight-only quantisation under tensor parallelism: each rank keeps its slice of the
single-process quantised weights with the scales (and int4 zero points) of that slice.

The split is checked exactly on one layer (the ranks' partial outputs sum to the unsplit
quantised layer's), and end to end: a quantised TP=2 engine gives the logits and greedy tokens of
the quantised single-process engine. Both run the reference matmul backend
(TOKENYARD_QUANT_BACKEND=torch, fp32): torch's packed CPU ops round each rank's partial product
to bf16, which would hide a wrong scale behind a 1e-2 tolerance."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.engine_helpers import random_prompts, run_to_completion
from tests.engines.test_tensor_parallel import runner_logits
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.quant.quantization import quantize_weight, save_quantized
from tokenyard.engines.quant.tp_shard import take_cols, take_rows

OPTS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False, tp_timeout_s=30.0,
            quant_group_size=32)
LOGIT_TOL = 1e-4   # relative, as the tensor-parallel parity test


def quant_layer(mode: str, n: int = 48, k: int = 128) -> QuantLinear:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(n, k, generator=g)
    return QuantLinear(quantize_weight(w, mode, 32), torch.randn(n, generator=g), backend="torch")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_split_layout_reproduces_the_unsplit_layer(monkeypatch, mode):
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "torch")   # the split layers' backend: exact fp32
    full = quant_layer(mode)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(8))
    want = full(x)
    # Row parallel (o_proj, down_proj): input columns by rank, bias on rank 0; outputs summed.
    parts = [take_cols(full, r * 64, 64, keep_bias=r == 0) for r in range(2)]
    summed = parts[0](x[:, :64]) + parts[1](x[:, 64:])
    # Two half sums added vs one 128-term sum: the same products in another order. fp32 error bound
    # 128 * eps * sum |x w| (about 1.5e-5 at these magnitudes; seen 1.5e-5 on an AVX2 CPU's BLAS).
    w_t = full(torch.eye(128)) - full.bias                  # the layer's float weight, transposed
    bound = 128 * torch.finfo(torch.float32).eps * (x.abs() @ w_t.abs())
    assert ((summed - want).abs() <= bound + 1e-6).all(), (summed - want).abs().max()
    # Column parallel (qkv_proj, gate_up_proj): output rows by rank, several runs concatenated.
    ranges = [(0, 8), (24, 8)]
    rows = take_rows(full, ranges)
    assert torch.allclose(rows(x), torch.cat([want[:, 0:8], want[:, 24:32]], dim=1), rtol=0, atol=1e-6)
    assert isinstance(rows, QuantLinear) and rows.mode == mode


def test_float_linear_splits_too():
    lin = nn.Linear(64, 16)
    x = torch.randn(3, 64)
    parts = [take_cols(lin, r * 32, 32, keep_bias=r == 0) for r in range(2)]
    assert torch.allclose(parts[0](x[:, :32]) + parts[1](x[:, 32:]), lin(x), atol=1e-6)


def test_int4_group_must_divide_each_ranks_slice():
    full = quant_layer("int4", k=64)   # 2 groups of 32: a 3-way split cuts a group
    with pytest.raises(ValueError, match="multiple of it"):
        take_cols(full, 16, 16, keep_bias=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, stored", [("int4", False), ("int8", True)])
def test_quantised_tp2_matches_single_process(checkpoint_dir, monkeypatch, tmp_path, mode, stored):
    """int4 quantised at load; int8 from a checkpoint written by `tokenyard quantize` (the ranks
    split the stored codes and scales)."""
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "torch")   # the spawned ranks inherit it
    path = checkpoint_dir("llama")
    if stored:
        path = save_quantized(path, tmp_path / "int8", "int8", progress=False)
    prompts = random_prompts(4, 4, 40, 512, seed=61)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    logits, tokens = {}, {}
    for tp in (1, 2):
        eng = Engine(path, tensor_parallel_size=tp, quantization=mode, **OPTS)
        try:
            layer = eng.model.layers[0]
            assert isinstance(layer.o_proj, QuantLinear) and isinstance(layer.qkv_proj, QuantLinear)
            assert layer.o_proj.in_features == eng.model_config.num_heads * eng.model_config.head_dim // tp
            logits[tp] = runner_logits(eng, prompts[0])
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            tokens[tp] = run_to_completion(eng)
        finally:
            eng.close()
    err = (logits[2] - logits[1]).abs().max() / logits[1].abs().max()
    assert logits[2].shape == logits[1].shape and err <= LOGIT_TOL, f"relative logit error {err:.2e}"
    assert tokens[2] == tokens[1]
