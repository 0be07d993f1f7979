"""Prefill time (TTFT of a one-token request) for none / int8 / int4 on the quantisation
benchmark's 200M Llama: the packed CPU ops cost per row, so long prompts are where they hurt.

    .venv/bin/python -m bench.quant_prefill [--tokens 512] [--prompts 8] [--packed-int8]

The model is the one `python -m bench.quant_bench` builds in bench/out/quant-llama-200m (run
that first). The engines are loaded side by side and the prompts interleaved across modes;
reported: median and minimum over all but the first prompt (warm-up). --packed-int8 forces
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
MODES = ("none", "int8", "int4")


def engine_for(mode: str) -> Engine:
    return Engine(MODEL, dtype="bfloat16", quantization=mode, kv_cache_memory=256 << 20, progress=False,
                  enable_prefix_caching=False)


def prefill_s(eng: Engine, rid: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8)
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
        import engines.quant.quantized_linear as ql
        ql.DENSE_MIN_ROWS = 1 << 60
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 30000, (args.tokens,), generator=g).tolist() for _ in range(args.prompts)]
    # Every mode's engine loaded first, then the prompts interleaved across modes: a burst of
    # other work on a shared machine then lands on every mode alike, not on one.
    engines = {mode: engine_for(mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i, p in enumerate(prompts):
        for mode, eng in engines.items():
            times[mode].append(1e3 * prefill_s(eng, f"r{i}", p))
    print(f"| mode | {args.tokens}-token prefill ms |\n| --- | --- |")
    figures, runs = {}, []
    for mode in MODES:
        ms = statistics.median(times[mode][1:])          # the first prompt is the warm-up
        figures[f"{mode}_prefill_ms_median"] = ms
        # The fastest prompt too: on a machine shared with other work single prefills vary
        # several-fold, and the minimum is the estimate of the cost without the neighbours.
        figures[f"{mode}_prefill_ms_min"] = min(times[mode][1:])
        runs.append({"mode": mode, "prefill_ms_per_prompt": [round(t, 2) for t in times[mode]]})
        print(f"| {mode} | {ms:.0f} |")
    if not args.no_results:
        rec.write(figures, runs, tokens=args.tokens, prompts=args.prompts, packed_int8=args.packed_int8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
