"""What a rest costs on this machine: memory reads, and the engine's requests, after the CPU sat idle
(issue 52, item 1: "the first request after ready no slower than the tenth").

Three measurements, the first and last without Tokenyard's engine:

- `sweep`: read one float per 64-byte line of a 128 MiB array (the size of SmolLM2's streamed weights)
  right after a rest of R ms, then again 5 times back to back; per R, the median time of the first
  read and of the fifth. A machine with no rest cost reads as fast after any rest.
- `engine`: SmolLM2-135M of the packaged deployment, in this process (the C decode step, its weights
  in huge pages), serves an 8-token prompt for 8 greedy tokens after a rest of R ms; per R, the median
  request time and its prefill step. A replica's first request after ready meets such a rest (the warm-up
  request's end, the ready handshake, the client's poll), the others in a row meet ~5 ms.
- `first_touch`: fresh processes each map 96 MiB, ask for huge pages and touch them (what the C step's
  arena did at every start before tokenyard/kernels/page_reserve.py); per process, the milliseconds.

    python -m tokenyard.bench.rest_cost [--rests-ms 2 5 20 50 200 1500] [--repeats 12] [--no-engine]
        [--name rest_cost]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

SWEEP_BYTES = 128 << 20
TOUCH_BYTES = 96 << 20
_TOUCH = f"""
import ctypes, mmap, time
m = mmap.mmap(-1, {TOUCH_BYTES}, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.madvise(mmap.MADV_HUGEPAGE)
a = ctypes.c_char.from_buffer(m); base = ctypes.addressof(a)
t = time.perf_counter()
for at in range(0, {TOUCH_BYTES}, 2 << 20):
    ctypes.memset(base + at, 1, 1)
print((time.perf_counter() - t) * 1000)
"""


def sweep(rests_ms: list[float], repeats: int) -> dict[str, dict[str, float]]:
    lines = np.ones(SWEEP_BYTES // 4, dtype=np.float32)[::16]      # one float per cache line
    lines.sum()
    out = {}
    for rest in rests_ms:
        first, fifth = [], []
        for _ in range(repeats):
            time.sleep(rest / 1000)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                lines.sum()
                times.append((time.perf_counter() - t0) * 1000)
            first.append(times[0])
            fifth.append(times[4])
        out[f"{rest:g}"] = {"first_read_ms": statistics.median(first), "fifth_read_ms": statistics.median(fifth)}
        print(f"sweep after {rest:g} ms: first {out[f'{rest:g}']['first_read_ms']:.2f} ms, "
              f"fifth {out[f'{rest:g}']['fifth_read_ms']:.2f} ms", flush=True)
    return out


def engine_requests(rests_ms: list[float], repeats: int) -> dict[str, Any]:
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.serving.engine_core import EngineRecipe
    from tokenyard.gateway.config.deployment import load_deployment
    spec = load_deployment().engines["smollm2-135m"]
    assert spec.model is not None, "the packaged deployment names SmolLM2's file"
    engine = EngineRecipe(spec.type, spec.model, spec.options).build()
    out: dict[str, Any] = {}
    n = 0
    for rest in rests_ms:
        totals, prefills = [], []
        for _ in range(repeats):
            time.sleep(rest / 1000)
            n += 1
            engine.add_request(f"r{n}", [1, 2, 3, 4, 5, 6, 7, 8],
                               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            t0 = time.perf_counter()
            steps = []
            while engine.has_unfinished():
                ts = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - ts)
            totals.append((time.perf_counter() - t0) * 1000)
            prefills.append(steps[0] * 1000)
        out[f"{rest:g}"] = {"request_ms": statistics.median(totals), "prefill_step_ms": statistics.median(prefills)}
        print(f"engine after {rest:g} ms: request {out[f'{rest:g}']['request_ms']:.1f} ms, "
              f"prefill step {out[f'{rest:g}']['prefill_step_ms']:.1f} ms", flush=True)
    return out


def first_touch(processes: int) -> list[float]:
    out = []
    for _ in range(processes):
        done = subprocess.run([sys.executable, "-c", _TOUCH], capture_output=True, text=True, timeout=60, check=True)
        out.append(float(done.stdout.strip()))
    print("first touch of 96 MiB of huge pages, ms per process:", [round(x, 1) for x in out], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rests-ms", type=float, nargs="+", default=[2, 5, 20, 50, 200, 1500])
    ap.add_argument("--repeats", type=int, default=12, help="reads or requests per rest")
    ap.add_argument("--touch-processes", type=int, default=12)
    ap.add_argument("--no-engine", action="store_true", help="skip the engine (no model needed)")
    ap.add_argument("--name", default="rest_cost", help="results file: bench/results/NAME.json")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    if args.repeats < 1 or any(r < 0 for r in args.rests_ms):
        ap.error("--repeats must be >= 1 and every rest >= 0")
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.name)
    figures: dict[str, Any] = {"sweep": sweep(args.rests_ms, args.repeats)}
    if not args.no_engine:
        figures["engine"] = engine_requests(args.rests_ms, args.repeats)
    touches = first_touch(args.touch_processes) if args.touch_processes > 0 else []
    if touches:
        figures["first_touch_ms"] = {"median": statistics.median(touches), "max": max(touches),
                                     "min": min(touches), "over_100ms": sum(t > 100 for t in touches),
                                     "processes": len(touches)}
    if not args.no_results:
        print("wrote", rec.write(figures, [{"first_touch_ms": touches}], rests_ms=args.rests_ms, repeats=args.repeats,
                                 sweep_bytes=SWEEP_BYTES, touch_bytes=TOUCH_BYTES))


if __name__ == "__main__":
    main()
