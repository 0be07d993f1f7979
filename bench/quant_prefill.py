"""Prefill time (TTFT of a one-token request) for none / int8 / int4 on the quantisation
benchmark's 200M Llama: the packed CPU ops cost per row, so long prompts are where they hurt.

    .venv/bin/python -m bench.quant_prefill [--tokens 512] [--prompts 4] [--packed-int8]

The model is the one `python -m bench.quant_bench` builds in bench/out/quant-llama-200m (run
that first). Reported: median over all but the first prompt (warm-up). --packed-int8 forces
int8 onto the packed op at every size, to compare with the dequantise-then-GEMM path.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from engines import Engine, SamplingParams

MODEL = Path("bench/out/quant-llama-200m")


def prefill_ms(mode: str, prompts: list[list[int]]) -> tuple[float, list[float]]:
    eng = Engine(MODEL, dtype="bfloat16", quantization=mode, kv_cache_memory=256 << 20, progress=False,
                 enable_prefix_caching=False)
    times = []
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0.0))
        while eng.has_unfinished():
            eng.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:]), [round(1e3 * t, 2) for t in times]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--packed-int8", action="store_true", help="int8 always through the packed op")
    ap.add_argument("--no-results", action="store_true",
                    help="do not write bench/results/quant_prefill[_packed_int8].json")
    args = ap.parse_args(argv)
    from bench.results_io import RunRecorder
    rec = RunRecorder("quant_prefill" + ("_packed_int8" if args.packed_int8 else ""))
    if not (MODEL / "config.json").is_file():
        print(f"{MODEL} is missing: run `python -m bench.quant_bench` first (it builds the model)")
        return 2
    if args.packed_int8:
        import engines.quantized_linear as ql
        ql.DENSE_MIN_ROWS = 1 << 60
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (args.tokens,), generator=g).tolist() for _ in range(args.prompts)]
    print(f"| mode | {args.tokens}-token prefill ms |\n| --- | --- |")
    figures, runs = {}, []
    for mode in ("none", "int8", "int4"):
        ms, times = prefill_ms(mode, prompts)
        figures[f"{mode}_prefill_ms_median"] = ms
        runs.append({"mode": mode, "prefill_ms_per_prompt": times})
        print(f"| {mode} | {ms:.0f} |")
    if not args.no_results:
        rec.write(figures, runs, tokens=args.tokens, prompts=args.prompts, packed_int8=args.packed_int8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
