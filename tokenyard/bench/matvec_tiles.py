"""Register-tile shapes of the C decode step's products (tokenyard/kernels/cpu_matvec.c), timed on one thread.

    .venv/bin/python -m tokenyard.bench.matvec_tiles [--tiles 4x3 2x4 4x2 3x4] [--batches 1 4 8 32 64 96]
        [--kinds f32] [--rounds 5] [--name matvec_tiles]

Each tile shape is a build of the step's library with -DTY_TR/-DTY_TT (int4 kinds: -DTY4_TR/-DTY4_TT;
`--dequant-batches` adds builds with another -DTY_DEQUANT_BATCH; `--panel-batches` builds with packed
panels (tokenyard/kernels/cpu_matvec_panel.c) from another batch, e.g. 100000 for the dot-product tiles at every
batch, 2 for panels at every batch but 1). The W2 model's projections (gate_up
2816x512, down 512x1408, lm_head 8192x512) are multiplied by `batch` random inputs through
Library.matvec; per round every variant runs once in turn (interleaved), best of a few calls per
shape, and the figure is the median over rounds of the summed milliseconds of the three shapes, as
GFLOP/s. The default shape for this machine's vector width is the fastest here. Writes
bench/results/<name>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenyard.bench.results_io import RunRecorder
from tokenyard.kernels import cpu_decode_step
from tokenyard.kernels.cpu_decode_step import Library, StepLinear
from tokenyard.nativelib.build import cached_library

SHAPES = {"gate_up": (2816, 512), "down": (512, 1408), "lm_head": (8192, 512)}


def _library(extra: tuple[str, ...]) -> Library:
    path = cached_library(cpu_decode_step.SOURCE, cpu_decode_step.flags() + extra, "decode_step_variant",
                          includes=cpu_decode_step.INCLUDES)
    return Library(path)


def _linears(kind: str, g: torch.Generator) -> dict[str, StepLinear]:
    out = {}
    for name, (n, k) in SHAPES.items():
        if kind == "f32":
            out[name] = StepLinear.f32(torch.randn(n, k, generator=g))
        elif kind == "int8":
            out[name] = StepLinear.int8(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                                        torch.rand(n, generator=g))
        else:
            out[name] = StepLinear.int4(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // 32, generator=g),
                                        torch.rand(n, k // 32, generator=g), 32)
    return out


def _best_ms(lib: Library, lin: StepLinear, x: torch.Tensor, out: torch.Tensor, calls: int) -> float:
    best = float("inf")
    lin = lib.prepare(lin)          # the form this build reads (int4 in 16-row blocks on AVX-512 VNNI), untimed
    for _ in range(calls):
        t0 = time.perf_counter()
        lib.matvec(lin, x, out=out)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", nargs="*", default=["4x3", "2x4", "4x2", "3x4", "4x6"])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8, 32, 64, 96])
    ap.add_argument("--kinds", nargs="*", default=["f32"], choices=["f32", "int8", "int4"])
    ap.add_argument("--dequant-batches", type=int, nargs="*", default=[],
                    help="also builds with quantised rows widened into an fp32 panel from these batches on")
    ap.add_argument("--block-kib", type=int, nargs="*", default=[],
                    help="also builds with token blocks of at most this many KiB of inputs (-DTY_BLOCK_BYTES)")
    ap.add_argument("--panel-batches", type=int, nargs="*", default=[],
                    help="also builds whose fp32 products use packed panels from these batches on (-DTY_PANEL_BATCH)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--name", default="matvec_tiles")
    args = ap.parse_args(argv)
    rec = RunRecorder(args.name)
    variants: dict[str, Library] = {"default": _library(())}
    for t in args.tiles:
        r, c = (int(v) for v in t.split("x"))
        variants[t] = _library((f"-DTY_TR={r}", f"-DTY_TT={c}", f"-DTY4_TR={r}", f"-DTY4_TT={c}"))
    for kib in args.block_kib:
        variants[f"block{kib}k"] = _library((f"-DTY_BLOCK_BYTES={kib * 1024}",))
    for b in args.dequant_batches:
        variants[f"dequant{b}"] = _library((f"-DTY_DEQUANT_BATCH={b}",))
    for b in args.panel_batches:
        variants[f"panels{b}"] = _library((f"-DTY_PANEL_BATCH={b}",))
    g = torch.Generator().manual_seed(0)
    runs, figures = [], {}
    flops_per_token = 2 * sum(n * k for n, k in SHAPES.values())
    for kind in args.kinds:
        lins = _linears(kind, g)
        for batch in args.batches:
            x = {name: torch.randn(batch, k, generator=g) for name, (n, k) in SHAPES.items()}
            outs = {name: torch.empty(batch, n) for name, (n, k) in SHAPES.items()}
            names = list(variants)
            for rnd in range(args.rounds):
                order = names if rnd % 2 == 0 else names[::-1]
                for v in order:
                    ms = sum(_best_ms(variants[v], lins[s], x[s], outs[s], args.calls) for s in SHAPES)
                    runs.append({"kind": kind, "batch": batch, "variant": v, "round": rnd, "ms": ms})
            row = {}
            for v in names:
                ms = statistics.median(r["ms"] for r in runs if (r["kind"], r["batch"], r["variant"]) == (kind, batch, v))
                row[v] = {"ms": round(ms, 4), "gflops": round(flops_per_token * batch / ms / 1e6, 2)}
            figures[f"{kind}_b{batch}"] = row
            print(f"{kind} batch {batch:3d}: " + "  ".join(f"{v} {row[v]['gflops']:.1f}" for v in names)
                  + "  GFLOP/s", flush=True)
    rec.write(figures=figures, runs=runs)


if __name__ == "__main__":
    main()
