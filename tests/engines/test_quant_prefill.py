"""The CPU backend's dense prefill path for weight-only int4/int8 (issue 26 item 4): from
INT4_DENSE_MIN_ROWS / INT8_DENSE_MIN_ROWS rows on, QuantLinear dequantises the packed weight to
bf16 tile by tile and runs bf16 GEMMs (tokenyard/kernels/quant_matmul_torch.py) instead of torch's packed op.

Tolerances (u = 2^-9, the bf16 unit roundoff; x_b = x rounded to bf16, the input both paths see):
- Weights: exact. The dense path's bf16 weight equals the packed op's weight rounded to bf16, bit
  for bit: rows of the identity through the packed op return exactly that (one nonzero product
  per output, accumulated in fp32, rounded to bf16 once), for int4 (integer zero points and float
  minimums, padded N, a narrower last block) and int8.
- Dense vs the float reference x_b @ w.T (w: the layout's fp32 dequantisation): the packed op's
  bound (tests/engines/test_quantization.py: bf16 scale and zero', output rounding) plus u * |w| per weight
  for the bf16 weight, with the same 2x margin.
- Dense vs packed: both within their bounds of the same reference, so within the sum of the two.
- Tiles: the column tiles are independent GEMMs over the same K, so tiling changes nothing but
  which kernel blocking the GEMM picks: asserted within 2 u * |x_b| @ |w|.T (measured: equal).
- The engine: prompt logits (150 tokens) of the random int4 Llama through the dense path vs the
  packed op, both with bf16 activations: measured max |dlogit| 2.0% of the position's max |logit|
  and argmax agreement 99.3% (1.7-2.0%, 97.3-99.3% over 3 prompts). That is the size of bf16
  rounding on this tiny random model: its bf16 engine vs its fp32 engine differ by 1.4-2.0% and
  96.7-99.3% on the same prompts. Asserted: <= 4% and >= 90%.
"""
from __future__ import annotations

import platform

import pytest
import torch

import tokenyard.engines.model.quantized_linear as ql
from tests.engine_helpers import prompt_logits
from tokenyard.engines import Engine
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.kernels import cpu_gemm
from tokenyard.kernels import quant_matmul_torch as qm
from tokenyard.kernels.quant_layout import Int4Weight, dequantize_int4_weight, dequantize_int8, quantize_int4, quantize_int8

ULP = 2.0 ** -9
NEVER = 1 << 60


@pytest.fixture
def path(monkeypatch):
    """path("dense") / path("packed"): every call of either QuantLinear mode on that path."""
    def use(which: str) -> None:
        rows = 1 if which == "dense" else NEVER
        monkeypatch.setattr(ql, "INT4_DENSE_MIN_ROWS", rows)
        monkeypatch.setattr(ql, "INT8_DENSE_MIN_ROWS", rows)
    return use


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16_gemm", "fp32_gemm"])
def gemm(request):
    """The dense path's GEMM dtype, both of them whatever this CPU's probe would pick."""
    cpu_gemm.set_dense_dtype(request.param)
    yield request.param
    cpu_gemm.set_dense_dtype(None)


def _int4(n: int, k: int, group: int, seed: int, mins: bool) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    # rows with different spreads and offsets, so float minimums are far from -8 * scale
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.2 + (torch.rand(n, 1, generator=g) - 0.5) * 0.6
    q = quantize_int4(w, group)
    return q.with_mins() if mins else q


def test_the_int4_packing_of_this_torch_is_readable():
    layout = qm.int4pack_cpu_layout()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert layout in ((64, True), (32, True), (32, False)), layout  # AVX512, AVX2, no vector unit
    lin = QuantLinear(quantize_int4(torch.randn(64, 64), 32))
    assert (lin._dense_tiles is None) == (layout is None)


@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("n,k,group", [(64, 128, 32), (40, 256, 64), (176, 128, 128), (960, 64, 32)])
def test_dense_int4_weights_are_the_packed_ops_weights_in_bf16(path, n, k, group, mins):
    """n = 40: padded to 48 rows (one narrower block); 176: two full blocks of 64 and one of 48."""
    if qm.int4pack_cpu_layout() is None:
        pytest.skip("this torch packs int4 in a layout the dense path does not read")
    lin = QuantLinear(_int4(n, k, group, n + k, mins))
    eye = torch.eye(k, dtype=torch.bfloat16)
    path("packed")
    seen_by_packed_op = lin(eye)                 # [K, N]: W.T as the op computes it, rounded to bf16
    dense_w = qm.int4pack_dequant_t(lin.packed, lin.scale_zero, lin._n_padded, k, group, qm.int4pack_cpu_layout(),
                                    0, lin._n_padded)[:, :n]
    assert dense_w.dtype == torch.bfloat16
    assert torch.equal(dense_w, seen_by_packed_op)
    path("dense")
    assert torch.equal(lin(eye), seen_by_packed_op)


@pytest.mark.parametrize("n,k", [(48, 256), (33, 128)])
def test_dense_int8_weights_are_the_packed_ops_weights_in_bf16(path, n, k):
    lin = QuantLinear(quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.05))
    eye = torch.eye(k, dtype=torch.bfloat16)
    path("packed")
    want = lin(eye)
    path("dense")
    assert torch.equal(lin(eye), want)


def _check_against_reference(y, y_packed, xb, w_ref, err_w_packed):
    """y (dense) and y_packed within their bounds of xb @ w_ref.T; see the module doc."""
    ref = xb @ w_ref.t()
    out_round = ULP * (xb.abs() @ w_ref.abs().t())
    bound_packed = 2 * (xb.abs() @ err_w_packed.t() + out_round) + 1e-6
    bound_dense = 2 * (xb.abs() @ (err_w_packed + ULP * w_ref.abs()).t() + out_round) + 1e-6
    err = (y - ref).abs()
    assert (err <= bound_dense).all(), float((err / bound_dense).max())
    assert ((y_packed - ref).abs() <= bound_packed).all()
    assert ((y - y_packed).abs() <= bound_dense + bound_packed).all()


@pytest.mark.parametrize("mins", [False, True])
@pytest.mark.parametrize("m", [64, 130])
def test_dense_int4_matmul_within_bounds_of_the_float_reference_and_the_packed_op(path, gemm, m, mins):
    n, k, group = 176, 256, 32
    q = _int4(n, k, group, m, mins)
    bias = torch.randn(n)
    lin = QuantLinear(q, bias=bias)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    path("packed")
    y_packed = lin(x) - bias
    path("dense")
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    y = y - bias
    w = dequantize_int4_weight(q)
    s = q.scales.float().repeat_interleave(group, dim=1)
    zp = (q.mins.float() if mins else -q.zeros.float() * q.scales.float()).repeat_interleave(group, dim=1) + 8 * s
    qv = ((w - zp) / s + 8).round()  # the stored nibble, from w = (q - 8) * s + zero'
    err_w = ULP * ((qv - 8).abs() * s + zp.abs())  # bf16 scale and zero'
    _check_against_reference(y, y_packed, x.bfloat16().float(), w, err_w)


@pytest.mark.parametrize("m", [64, 100])
def test_dense_int8_matmul_within_bounds_of_the_float_reference_and_the_packed_op(path, gemm, m):
    n, k = 96, 256
    q = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(7)) * 0.05)
    lin = QuantLinear(q)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    path("packed")
    y_packed = lin(x)
    path("dense")
    y = lin(x)
    w = dequantize_int8(q.w_q, q.scales)
    _check_against_reference(y, y_packed, x.bfloat16().float(), w, ULP * w.abs())  # bf16 scale


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_threshold_switches_between_the_packed_op_and_the_dense_path(monkeypatch, mode):
    calls: list[str] = []
    dense_fn = "int4pack_dense_mm" if mode == "int4" else "int8_dense_mm"
    packed_op = "_INT4_MM" if mode == "int4" else "_INT8_MM"
    for name, label in ((dense_fn, "dense"), (packed_op, "packed")):
        real = getattr(ql, name)
        monkeypatch.setattr(ql, name, lambda *a, _real=real, _label=label, **kw: (calls.append(_label), _real(*a, **kw))[1])
    w = torch.randn(64, 64)
    lin = QuantLinear(quantize_int4(w, 32) if mode == "int4" else quantize_int8(w))
    threshold = ql.INT4_DENSE_MIN_ROWS if mode == "int4" else ql.INT8_DENSE_MIN_ROWS
    for m in (1, threshold - 1, threshold, threshold + 37):
        calls.clear()
        lin(torch.randn(m, 64))
        assert calls == ["dense" if m >= threshold else "packed"], (m, calls)
    # rows, not tokens of one sequence: [batch, seq, K] counts batch * seq
    calls.clear()
    lin(torch.randn(2, threshold // 2, 64))
    assert calls == ["dense"]
    assert lin(torch.randn(0, 64)).shape == (0, 64)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_column_tiles_bound_the_transient_weight_and_change_nothing(path, monkeypatch, mode):
    n, k = 200, 128
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    q = quantize_int4(w, 32) if mode == "int4" else quantize_int8(w)
    x = torch.randn(96, k, generator=torch.Generator().manual_seed(4))
    path("dense")
    whole = QuantLinear(q)
    monkeypatch.setattr(ql, "DENSE_TILE_WEIGHTS", 64 * k)   # 64 output columns per tile
    tiled = QuantLinear(q)
    if mode == "int4" and qm.int4pack_cpu_layout() is not None:
        assert len(whole._dense_tiles) == 1 and len(tiled._dense_tiles) > 1
        assert tiled._dense_tiles[-1][1] == tiled._n_padded
        assert all(b - a <= 64 for a, b in tiled._dense_tiles[:-1])
    xb = x.bfloat16().float()
    wd = dequantize_int4_weight(q) if mode == "int4" else dequantize_int8(q.w_q, q.scales)
    assert ((tiled(x) - whole(x)).abs() <= 2 * ULP * (xb.abs() @ wd.abs().t())).all()


def test_int4pack_dense_tiles():
    assert qm.int4pack_dense_tiles(960, (64, True), 1 << 20) == [(0, 960)]
    assert qm.int4pack_dense_tiles(960, (64, True), 300) == [(0, 256), (256, 512), (512, 768), (768, 960)]
    assert qm.int4pack_dense_tiles(176, (64, True), 64) == [(0, 64), (64, 176)]   # the 48-row block goes last
    assert qm.int4pack_dense_tiles(48, (64, True), 64) == [(0, 48)]
    assert qm.int4pack_dense_tiles(96, (32, True), 10) == [(0, 32), (32, 64), (64, 96)]


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_compiled_graphs_take_the_packed_op_without_guarding_the_row_count(path, mode):
    """The CPU decode graph is compiled with the batch dynamic over 2..max_num_seqs
    (tokenyard/engines/model/compiled_decoder.py, mark_dynamic): a branch on the row count would guard that
    range at the threshold, which dynamo refuses (ConstraintViolationError). Under torch.compile
    QuantLinear takes the packed op at every size, eager calls switch at the threshold. dynamo with
    fullgraph (a graph break is an error) and the eager backend: no compiler needed."""
    torch._dynamo.reset()
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    lin = QuantLinear(quantize_int4(w, 32) if mode == "int4" else quantize_int8(w))
    compiled = torch.compile(lin, backend="eager", fullgraph=True, dynamic=False)
    big = max(ql.INT4_DENSE_MIN_ROWS, ql.INT8_DENSE_MIN_ROWS) + 10
    xs = [torch.randn(m, 128, generator=torch.Generator().manual_seed(m)) for m in (4, big)]
    for x in xs:
        torch._dynamo.mark_dynamic(x, 0, min=2, max=2 * big)
    ys = [compiled(x) for x in xs]
    path("packed")
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y, lin(x), rtol=0, atol=0)
    torch._dynamo.reset()


def test_the_dense_kernels_trace_without_graph_breaks():
    """For a compiled prefill (static shapes) one day: both dense kernels trace in one graph."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    w = torch.randn(176, 128, generator=g)
    l4, l8 = QuantLinear(quantize_int4(w, 32)), QuantLinear(quantize_int8(w))
    xb = torch.randn(80, 128, generator=g).bfloat16()
    layout = qm.int4pack_cpu_layout()   # probed once, outside any graph (as QuantLinear does)
    if layout is None:
        pytest.skip("this torch packs int4 in a layout the dense path does not read")
    tiles = qm.int4pack_dense_tiles(l4._n_padded, layout, 64)

    def both(xb):
        y4 = qm.int4pack_dense_mm(xb, l4.packed, l4.scale_zero, l4._n_padded, 128, 32, layout, tiles)
        return y4, qm.int8_dense_mm(xb, l8.w_q, l8.scales, 64)

    got = torch.compile(both, backend="eager", fullgraph=True)(xb)
    for a, b in zip(got, both(xb)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch._dynamo.reset()


def test_engine_prompt_logits_dense_vs_packed_int4(checkpoint_dir, path):
    eng = Engine(checkpoint_dir("llama"), quantization="int4", quant_group_size=32, kv_cache_memory=16 << 20,
                 progress=False, enable_prefix_caching=False)
    ids = torch.randint(3, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    path("packed")
    a = prompt_logits(eng, ids)
    path("dense")
    b = prompt_logits(eng, ids)
    rel = (a - b).abs().amax(-1) / a.abs().amax(-1)
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    print(f"int4 engine, dense vs packed prefill: max relative |dlogit| {float(rel.max()):.4f}, argmax agreement {agree:.3f}")
    assert float(rel.max()) <= 0.04 and agree >= 0.9


@pytest.mark.parametrize("fp32_s, bf16_s, want", [(1.0, 0.4, torch.bfloat16), (1.0, 1.0, torch.bfloat16),
                                                  (1.0, 60.0, torch.float32), (1.0, 1.3, torch.float32)])
def test_the_dense_gemm_dtype_is_bf16_only_where_this_cpu_multiplies_bf16_at_least_as_fast(monkeypatch, fp32_s,
                                                                                            bf16_s, want):
    # The probe times one GEMM per dtype; here the timings are given, the rule and the cache are tested.
    seen = []

    def fake(a, b, reps=3):
        seen.append(a.dtype)
        return bf16_s if a.dtype == torch.bfloat16 else fp32_s
    monkeypatch.setattr(cpu_gemm, "_best_seconds", fake)
    cpu_gemm.set_dense_dtype(None)
    try:
        assert cpu_gemm.dense_dtype() == want
        assert cpu_gemm.dense_dtype() == want and len(seen) == 2     # measured once, then cached
    finally:
        cpu_gemm.set_dense_dtype(None)
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        cpu_gemm.set_dense_dtype(torch.float16)
