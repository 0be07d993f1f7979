"""The C LoRA kernel (tokenyard/kernels/cpu_lora.c) against the torch reference (lora_torch.lora_add).

Random groups of 1-3 modules laid out as the adapter pool keeps them (A [slots, G*R, in], B block-diagonal
[slots, G*R, out]), pool ranks 1..64 with each slot's own rank below it (zeros past it), input widths
that are not multiples of the vector width, uneven segments (one row to dozens) and base rows that no
segment covers. Bound: max|out - ref| <= 1e-5 * max|ref - y| (the products' size; fp32, the summation
order differs), and base rows and the columns of modules no adapter targets are bit-for-bit untouched.
Skipped only when the machine has no C compiler.
"""
from __future__ import annotations

import pytest
import torch

from tokenyard.kernels import cpu_lora_native, lora_torch
from tokenyard.nativelib.build import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler: the native LoRA kernel cannot be built")

TOL = 1e-5


@pytest.fixture(scope="module")
def kernel():
    k = cpu_lora_native.Kernel(cpu_lora_native.compile_library())
    return k


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))   # noqa: E731
    n_modules = ri(1, 3)
    pool_rank = [1, 3, 8, 16, 17, 33, 64][seed % 7]
    k = ri(1, 300)
    widths = [ri(1, 200) for _ in range(n_modules)]
    # a module of the group no adapter targets (columns and A/B rows left out of the descriptor)
    skipped = ri(0, n_modules - 1) if n_modules > 1 and seed % 3 == 0 else -1
    n = sum(widths)
    offs = [sum(widths[:j]) for j in range(n_modules)]
    slots = ri(1, 8)
    ranks = [ri(1, pool_rank) for _ in range(slots)]
    a = torch.zeros(slots, n_modules * pool_rank, k)
    b = torch.zeros(slots, n_modules * pool_rank, n)
    for s, r in enumerate(ranks):
        for j in range(n_modules):
            if j == skipped:
                continue
            rows = slice(j * pool_rank, j * pool_rank + r)
            a[s, rows] = torch.randn(r, k, generator=g) / k ** 0.5
            b[s, rows, offs[j]:offs[j] + widths[j]] = torch.randn(r, widths[j], generator=g) / r ** 0.5
    scales = (torch.rand(slots, generator=g) + 0.5).tolist()
    rows = ri(1, 80)
    # uneven segments: each row's slot drawn with skewed odds, about a fifth of the rows on the base (-1)
    weights = torch.rand(slots + 1, generator=g) ** 3 + 0.01
    weights[0] = weights[1:].sum() / 4
    row_slots = (torch.multinomial(weights, rows, replacement=True, generator=g) - 1).tolist()
    # x as rows of a wider tensor (a row stride that is not its width)
    x = torch.randn(rows, k + 5, generator=g)[:, 2:2 + k]
    y = torch.randn(rows, n, generator=g)
    mods = [(j, offs[j], widths[j]) for j in range(n_modules) if j != skipped]
    return a, b, pool_rank, mods, scales, ranks, row_slots, x, y


def _torch_reference(a, b, pool_rank, mods, seg, x, y):
    out = y.clone()
    for j, off, width in mods:
        a_j = a[:, j * pool_rank:(j + 1) * pool_rank]
        b_j = b[:, j * pool_rank:(j + 1) * pool_rank, off:off + width].transpose(1, 2)
        lora_torch.lora_add(out[:, off:off + width], x, a_j, b_j, seg)
    return out


@pytest.mark.parametrize("seed", range(28))
def test_native_matches_the_torch_reference(kernel, seed):
    a, b, pool_rank, mods, scales, ranks, row_slots, x, y = _case(seed)
    seg = lora_torch.build_segments(row_slots, torch.device("cpu"))
    if seg is None:
        pytest.skip("every row drawn on the base")   # not reached with these seeds (checked below)
    seg.ranks = [ranks[s] for s in seg.slots]
    seg.scales = [scales[s] for s in seg.slots]
    ref = _torch_reference(a, b, pool_rank, mods, seg, x, y)
    got = y.clone()
    group = kernel.group(a, b, pool_rank, mods)
    kernel.add(got, x, group, kernel.segments(seg.perm, seg.starts, seg.slots, seg.ranks, seg.scales))
    size = (ref - y).abs().max().item()
    assert size > 0, "the case has no product (it would prove nothing)"
    assert (got - ref).abs().max().item() <= TOL * size
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])
    covered = torch.zeros(y.shape[1], dtype=torch.bool)
    for _, off, width in mods:
        covered[off:off + width] = True
    assert torch.equal(got[:, ~covered], y[:, ~covered])


def test_every_seed_has_adapter_rows():
    # the parametrised cases all reach the kernel (none is skipped for want of adapter rows)
    for seed in range(28):
        row_slots = _case(seed)[6]
        assert any(s >= 0 for s in row_slots), seed


def test_a_group_too_wide_for_the_kernel_is_not_taken(kernel):
    a = torch.zeros(1, kernel.max_width + 1, 8)
    assert not kernel.supports(a, 1, kernel.max_width + 1)
    assert not kernel.supports(torch.zeros(1, 16, 8, dtype=torch.bfloat16), 1, 16)
    assert kernel.supports(torch.zeros(2, 48, 8), 3, 16)


def test_the_knob_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("TOKENYARD_CPU_LORA", "torch")
    assert cpu_lora_native.load() is None
