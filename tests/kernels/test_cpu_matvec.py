"""The C decode step's matrix-vector products alone (tokenyard/kernels/cpu_matvec.c via Library.matvec).

Products run in register tiles of rows x tokens with 1-row and 1-token edges and a scalar tail
along k, over blocks of tokens; quantised weights are widened in the tile or, for larger batches,
into an fp32 panel. The engine-level tests (test_native_decode.py) use model shapes whose row
chunks and widths are multiples of 16, so they never reach the edges: here odd row ranges, odd
batches and k not a multiple of the vector width do, for fp32, int8 and int4 weights, stored and
accumulated, on each x86 vector path this machine can run (and the AVX-512 and VNNI ones are at
least compiled), in a build with tiny token blocks and an early panel, and in builds whose packed
panels start at 3 tokens and hold 40 inputs. Reference: float64 products
of the same weights; tolerance 1e-4 relative to the largest output (fp32 sums in another order).
"""
from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tokenyard.kernels import cpu_decode_step
from tokenyard.kernels.cpu_decode_step import INT4, INT4_ROWS16, Library, StepLinear, fp16_carries, int4_rows16
from tokenyard.nativelib.build import cached_library, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler: the C decode step cannot be built")

def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


_X86 = platform.machine() in ("x86_64", "AMD64")
# x86-64-v4 (AVX-512 without VNNI: vpmaddubsw in the int8-input products) where this CPU runs it; native
# takes vpdpbusd where the CPU has VNNI
_V4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= _cpu_flags()
MARCHES = ["native"] + (["x86-64-v3", "x86-64"] if _X86 else []) + (["x86-64-v4"] if _X86 and _V4 else [])
# a build whose token blocks hold 2000 bytes of inputs (3 to 12 tokens here) and whose quantised weights go
# through the fp32 panel from 3 tokens on, so that small shapes cross both boundaries (packed panels
# from 64 tokens, so that they stay out of the way)
SMALL_BLOCKS = ("-DTY_BLOCK_BYTES=2000", "-DTY_DEQUANT_BATCH=3", "-DTY_PANEL_BATCH=64")
# a build with packed panels (cpu_matvec_panel.c) from 3 tokens and 40 inputs a panel, so that k runs
# over several panels with an odd last one (the default build takes panels from 16 tokens: batch 20)
EARLY_PANELS = ("-DTY_PANEL_BATCH=3", "-DTY_KC=40")
VARIANTS = {"-small-blocks": SMALL_BLOCKS, "-early-panels": EARLY_PANELS}


def _lib(monkeypatch, march: str, extra: tuple[str, ...] = ()):
    monkeypatch.setenv("TOKENYARD_NATIVE_MARCH", march)
    if not extra:
        lib = cpu_decode_step.load()
        if lib is None:
            pytest.skip(f"the compiler cannot build -march={march}")
        return lib
    path = cached_library(cpu_decode_step.SOURCE, cpu_decode_step.flags() + extra, "decode_step_variant",
                          includes=cpu_decode_step.INCLUDES)
    return Library(path)


def _weights(kind: str, n: int, k: int, group: int, g: torch.Generator) -> tuple[StepLinear, torch.Tensor]:
    """A projection in the kernel's form and the exact weight it stands for (float64)."""
    bias = torch.randn(n, generator=g)
    if kind == "f32":
        w = torch.randn(n, k, generator=g)
        return StepLinear.f32(w, bias), w.double()
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        s = torch.rand(n, generator=g) * 0.02 + 0.001
        return StepLinear.int8(q, s, bias), q.double() * s.double()[:, None]
    q = torch.randint(0, 16, (n, k), generator=g)
    s = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    m = torch.randn(n, k // group, generator=g) * 0.1
    w = (q.double().reshape(n, k // group, group) * s.double()[..., None] + m.double()[..., None]).reshape(n, k)
    return StepLinear.int4(q, s, m, group, bias), w


def _codes(lin: StepLinear) -> torch.Tensor:
    """The int4 codes [n, k] of a row-major (GGUF-order) int4 projection."""
    n, k = lin.n, lin.k
    return torch.stack([torch.cat([row & 15, row >> 4], 1).flatten() for row in lin.w.reshape(n, k // 32, 16)])


def _int4_weight(lin: StepLinear, half: bool) -> torch.Tensor:
    """The float64 weight an int4 projection stands for; `half`: with its scales and minimums rounded to
    fp16, as the 16-row blocks store them."""
    n, k, group = lin.n, lin.k, lin.group
    s, m = (lin.scale.half(), lin.minv.half()) if half else (lin.scale, lin.minv)
    q = _codes(lin).double().reshape(n, k // group, group)
    return (q * s.double()[..., None] + m.double()[..., None]).reshape(n, k)


def _check(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float = 0.0) -> None:
    """|got - want| within fp32 rounding (1e-4 of the largest output) plus `bound` per element."""
    tol = 1e-4 * max(1.0, want.abs().max().item()) + bound
    assert bool(((got.double() - want).abs() <= tol).all()), float(((got.double() - want).abs() - tol).max())


def _int8_input_bound(kind: str, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor | float:
    """What rounding the inputs to int8 per 32-block (AVX2 and AVX-512 builds, int4 and int8 weights with k a
    multiple of 32, cpu_matvec.c) may move a product by: sum over blocks of d / 2 * sum |w| in the
    block, d = the block's max |x| / 127 (0 for every other product; applied to all builds alike)."""
    if kind == "f32" or w.shape[1] % 32:
        return 0.0
    n, k = w.shape
    half_step = x.double().abs().reshape(x.shape[0], k // 32, 32).amax(-1) / 254
    return half_step @ w.abs().reshape(n, k // 32, 32).sum(-1).T


@pytest.mark.parametrize("march", MARCHES + ["native-small-blocks", "native-early-panels", "x86-64-early-panels"])
@pytest.mark.parametrize("kind", ["f32", "int8", "int4"])
def test_products_match_float64_on_every_edge(monkeypatch, march, kind):
    suffix = next((v for v in VARIANTS if march.endswith(v)), "")
    if march.startswith("x86-64") and "x86-64" not in MARCHES:
        pytest.skip("x86 vector paths")
    lib = _lib(monkeypatch, march.removesuffix(suffix), VARIANTS.get(suffix, ()))
    g = torch.Generator().manual_seed(len(kind) * 7 + len(march))
    # k: 64 whole vectors; 72 and 37 leave a scalar tail (fp32 and int8; int4 needs whole 32-blocks)
    # int4 with rows in sixteens (48, 32): 16-row blocks where the build reads them, with part blocks at both
    # ends of the odd row range below
    shapes = [(23, 64, 32), (37, 128, 64)] + ([(29, 72, 0), (13, 37, 0)] if kind != "int4" else [(48, 96, 32), (32, 128, 64)])
    for n, k, group in shapes:
        lin, w = _weights(kind, n, k, group, g)
        if kind == "int4" and lib.prepare(lin).kind == INT4_ROWS16:
            w = _int4_weight(lin, half=True)       # the 16-row blocks hold fp16 scales and minimums
        for batch in (1, 2, 3, 4, 5, 7, 13, 20):
            x = torch.randn(batch, k, generator=g)
            want = x.double() @ w.T + lin.bias.double()
            bound = _int8_input_bound(kind, w, x)
            _check(lib.matvec(lin, x), want, bound)
            # an odd row range (edges of the row tiles) leaves the other rows untouched; accumulate adds
            start = torch.randn(batch, n, generator=g)
            out = start.clone()
            lib.matvec(lin, x, rows=(3, n - 2), out=out, accumulate=True)
            _check(out[:, 3:n - 2], start[:, 3:n - 2].double() + want[:, 3:n - 2],
                   bound if isinstance(bound, float) else bound[:, 3:n - 2])
            assert torch.equal(out[:, :3], start[:, :3]) and torch.equal(out[:, n - 2:], start[:, n - 2:])


def test_bad_arguments_are_refused(monkeypatch):
    lib = _lib(monkeypatch, "native")
    lin, _ = _weights("f32", 8, 16, 0, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"x must be \[batch, 16\]"):
        lib.matvec(lin, torch.zeros(2, 15))
    with pytest.raises(ValueError, match="matvec refused"):
        lib.matvec(lin, torch.zeros(2, 16), rows=(4, 9))
    with pytest.raises(ValueError, match="out must be"):
        lib.matvec(lin, torch.zeros(2, 16), out=torch.zeros(2, 7))


@pytest.mark.skipif(not _X86, reason="x86 vector paths")
@pytest.mark.parametrize("march, extra", [("x86-64-v4", ()), ("x86-64-v4", ("-mavx512vnni",)),
                                          ("x86-64-v3", ("-mavxvnni",))])
def test_the_avx512_and_vnni_paths_compile(tmp_path, monkeypatch, march, extra):
    """Machines without AVX-512 or VNNI cannot run those paths; they can at least build them."""
    monkeypatch.setenv("TOKENYARD_NATIVE_MARCH", march)
    try:
        path = cached_library(cpu_decode_step.SOURCE, cpu_decode_step.flags() + extra, "decode_step_variant",
                              tmp_path, includes=cpu_decode_step.INCLUDES)
    except (OSError, RuntimeError) as exc:
        if "unrecognized" in str(exc) or march in str(exc) or any(e in str(exc) for e in extra):
            pytest.skip(f"this compiler cannot build -march={march} {' '.join(extra)}: {exc}")
        raise
    assert path.exists() and path.stat().st_size > 0


def test_16_row_blocks_hold_the_same_codes_scales_and_minimums():
    """The repack is a permutation: each row's code at each k, and its scale and minimum per group, found
    where the layout (cpu_matvec_q8.c, TY_INT4R16) says (pure torch: runs on any machine)."""
    g = torch.Generator().manual_seed(3)
    n, k, group = 32, 128, 64
    lin, _ = _weights("int4", n, k, group, g)
    q = _codes(lin)
    packed = int4_rows16(lin)
    assert packed.kind == INT4_ROWS16 and lin.kind == INT4 and packed.w.numel() == lin.w.numel()
    w = packed.w.flatten()
    for r in (0, 5, 16, 31):
        for kk in (0, 3, 17, 31, 32, 77, 127):
            blk, o = divmod(kk, 32)
            h, i = divmod(o % 16, 4)
            byte = int(w[((r // 16) * (k // 32) + blk) * 256 + h * 64 + (r % 16) * 4 + i])
            assert (byte & 15 if o < 16 else byte >> 4) == int(q[r, kk])
        for j in range(k // group):
            at = ((r // 16) * (k // group) + j) * 16 + r % 16
            assert packed.scale.flatten()[at] == lin.scale[r, j].half()
            assert packed.minv.flatten()[at] == lin.minv[r, j].half()
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        int4_rows16(_weights("int4", 24, 64, 32, g)[0])


@pytest.mark.skipif(not _X86, reason="x86 vector paths")
def test_a_build_without_16_row_blocks_refuses_them(monkeypatch):
    lib = _lib(monkeypatch, "x86-64-v3")
    assert not lib.int4_rows16
    lin, _ = _weights("int4", 32, 64, 32, torch.Generator().manual_seed(4))
    assert lib.prepare(lin) is lin
    with pytest.raises(ValueError, match="matvec refused"):
        lib.matvec(int4_rows16(lin), torch.zeros(1, 64))


def test_scales_fp16_would_not_carry_keep_the_row_major_form(monkeypatch):
    lib = _lib(monkeypatch, "native")
    g = torch.Generator().manual_seed(5)
    lin, w = _weights("int4", 32, 64, 32, g)
    assert fp16_carries(lin)
    lin.scale[3, 1] = 1e-6                      # below fp16's normal range: 2^-14
    assert not fp16_carries(lin) and lib.prepare(lin) is lin
    x = torch.randn(2, 64, generator=g)
    _check(lib.matvec(lin, x), x.double() @ _int4_weight(lin, half=False).T + lin.bias.double(),
           _int8_input_bound("int4", _int4_weight(lin, half=False), x))
