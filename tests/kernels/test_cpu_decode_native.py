"""The C decode attention (tokenyard/kernels/cpu_decode_native.py): what the torch forms compute, over fp32
and int8 caches, vector and scalar paths; a clear error where it does not apply; the torch forms
where it cannot be built. Every-form parity over mixed groups is in tests/engines/test_kv_quant_folded.py.

Tolerance: both sides are fp32 with different summation orders and exp implementations (the C
kernel's vector exp has ~2e-7 relative error): atol 2e-5 on outputs of magnitude ~0.1-1."""
from __future__ import annotations

import logging

import pytest
import torch

import tokenyard.nativelib.build
from tokenyard.kernels import cpu_decode_native as native
from tokenyard.kernels import decode_group_torch as dg
from tokenyard.kernels import paged_attention_torch as pa
from tokenyard.kernels.kv_quant import QuantizedCache, quantize

ATOL = 2e-5
kernel_required = pytest.mark.skipif(native.load() is None, reason="the C decode kernel cannot be built here")


def _case(heads, kv_heads, head_dim, seq_lens, query_lens, dtype, block=16, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, at = [], 0
    for m in need:
        tables.append(perm[at:at + m])
        at += m
    k = torch.randn(kv_heads, (sum(need) + 2) * block, head_dim, generator=g)
    v = torch.randn(kv_heads, (sum(need) + 2) * block, head_dim, generator=g)
    if dtype is not None:
        k, v = QuantizedCache(*quantize(k, dtype)), QuantizedCache(*quantize(v, dtype))
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    plan = pa.TorchAttentionPlan.build(query_lens, seq_lens, tables, block, sliding_window=window)
    return q, k, v, plan


def _both(q, k, v, plan, scale):
    got, want = torch.empty_like(q), torch.empty_like(q)
    for grp in plan.decode_groups:
        got[grp.rows] = dg.attend_group(q, k, v, grp, scale, form="native")
        want[grp.rows] = dg.attend_group(q, k, v, grp, scale, form="batched")
    return got, want


@kernel_required
@pytest.mark.parametrize("dtype", [None, torch.int8])
@pytest.mark.parametrize("shape", [(8, 2, 64), (4, 4, 24), (6, 1, 12), (2, 2, 8)])  # hd % 8 != 0: scalar path
def test_native_matches_the_torch_form(dtype, shape):
    heads, kv_heads, head_dim = shape
    q, k, v, plan = _case(heads, kv_heads, head_dim, [5, 40, 300, 17, 129], [1, 3, 1, 2, 1], dtype, window=None)
    got, want = _both(q, k, v, plan, head_dim ** -0.5)
    assert want.abs().max() > 0.05
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@kernel_required
def test_a_sliding_window_and_large_scores_stay_exact():
    # large logits (scale 1) test the vector exp's range; the window masks most keys
    q, k, v, plan = _case(8, 2, 64, [700, 64], [1, 1], torch.int8, window=33)
    got, want = _both(q * 4, k, v, plan, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


@kernel_required
def test_too_many_query_rows_are_a_clear_error_and_the_default_falls_back():
    # 65 query heads on one kv head: more rows than the kernel's registers plan for
    q, k, v, plan = _case(65, 1, 16, [40], [1], None)
    grp = plan.decode_groups[0]
    with pytest.raises(ValueError, match="native"):
        dg.attend_group(q, k, v, grp, 0.25, form="native")
    out = dg.attend_group(q, k, v, grp, 0.25)          # chosen automatically: a torch form serves
    torch.testing.assert_close(out, dg.attend_group(q, k, v, grp, 0.25, form="sdpa"), atol=ATOL, rtol=0)


@kernel_required
def test_layers_share_one_work_buffer_without_seeing_each_other():
    q, k, v, plan = _case(8, 2, 64, [300, 77], [1, 1], torch.int8, seed=1)
    _, k2, v2, _ = _case(8, 2, 64, [300, 77], [1, 1], torch.int8, seed=2)
    grp = plan.decode_groups[0]
    dg.attend_group(q, k, v, grp, 0.125, form="native")
    work = grp.work
    second = dg.attend_group(q, k2, v2, grp, 0.125, form="native")
    assert grp.work is work
    torch.testing.assert_close(second, dg.attend_group(q, k2, v2, grp, 0.125, form="batched"), atol=ATOL, rtol=0)


def test_without_a_compiler_the_torch_forms_serve_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.setattr(tokenyard.nativelib.build.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None
    assert any("torch forms serve" in r.getMessage() for r in caplog.records)
    q, k, v, plan = _case(8, 2, 64, [100], [1], torch.int8)
    grp = plan.decode_groups[0]
    out = dg.attend_group(q, k, v, grp, 0.125)
    torch.testing.assert_close(out, dg.attend_group(q, k, v, grp, 0.125, form="batched"), atol=ATOL, rtol=0)
    monkeypatch.setattr(native, "_LOADED", {})
    monkeypatch.undo()


def test_the_environment_keeps_the_torch_forms(monkeypatch):
    monkeypatch.setenv("TOKENYARD_CPU_ATTENTION", "torch")
    assert native.load() is None


def test_the_build_is_cached_by_source_and_flags(tmp_path):
    if tokenyard.nativelib.build.compiler() is None:
        pytest.skip("no C compiler")
    lib = native.compile_library(tmp_path)
    stamp = lib.stat().st_mtime_ns
    assert native.compile_library(tmp_path) == lib and lib.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]
