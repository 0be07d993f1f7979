"""Prefill of the weight-only quantised engines on the CPU: torch's packed ops vs dequantise-then-GEMM.

    .venv/bin/python -m tokenyard.bench.quant_prefill --smollm2 [--tokens 128 512 2048] [--repeats 5]
    .venv/bin/python -m tokenyard.bench.quant_prefill --thresholds [--rounds 5]
    .venv/bin/python -m tokenyard.bench.quant_prefill [--tokens 512] [--prompts 8] [--packed-int8 | --packed]

--smollm2: prefill tok/s (a one-token request: the prefill and one sampled token, max_num_batched_tokens
  large enough for one step) of SmolLM2-135M-Instruct from its packaged GGUF, loaded as int4 (Q4_1
  blocks as stored, group 32), int8 (requantised), bf16 and fp32 (dequantised); the quantised engines
  run with bf16 activations (dtype auto, as served). int4 and int8 are timed twice per round: on the
  packed op at every M ("packed": int4's path before issue 26) and with the dense path above the
  thresholds of tokenyard/engines/model/quantized_linear.py ("dense"). Engines loaded side by side, rounds
  interleave every token count and mode; figures are medians over rounds (the first, a warm-up,
  excluded). Raw output: bench/results/quant_prefill_smollm2.json.
--thresholds: one QuantLinear per projection shape of SmolLM2-135M and of the 200M Llama below,
  int4 (group 32) and int8, timed on the packed op and on the dense path at M = 8 ... 512 rows;
  interleaved rounds, each the fastest of a few calls, median over rounds. The crossover per shape is
  the smallest M from which the dense path is faster at every larger M measured. Raw output:
  bench/results/quant_prefill_thresholds[_t<threads>][_cpu].json (--cpu-time with --threads 1: the
  thread's CPU time instead of the wall clock, which preemption by other work does not inflate).
default: prefill time (TTFT of a one-token request) for none / int8 / int4 on the quantisation
  benchmark's 200M Llama (`python -m tokenyard.bench.quant_bench` builds it in bench/out/quant-llama-200m);
  --packed-int8 keeps int8 on the packed op at every size, --packed both int8 and int4. Raw output:
  bench/results/quant_prefill[_packed_int8|_packed].json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import tokenyard.engines.model.quantized_linear as ql
from tokenyard.bench.results_io import RunRecorder

MODEL = Path("bench/out/quant-llama-200m")
MODES = ("none", "int8", "int4")
NEVER = 1 << 60


def set_dense(int8: bool, int4: bool) -> None:
    """Dense path above the shipped thresholds (True) or the packed op at every M (False)."""
    ql.INT8_DENSE_MIN_ROWS = _SHIPPED[0] if int8 else NEVER
    ql.INT4_DENSE_MIN_ROWS = _SHIPPED[1] if int4 else NEVER


_SHIPPED = (ql.INT8_DENSE_MIN_ROWS, ql.INT4_DENSE_MIN_ROWS)


# -- the 200M Llama (issue 7's measurement) -----------------------------------------------------

def engine_for(mode: str):
    from tokenyard.engines import Engine
    return Engine(MODEL, dtype="bfloat16", quantization=mode, kv_cache_memory=256 << 20, progress=False,
                  enable_prefix_caching=False, cpu_compile="off")


def prefill_s(eng, rid: str, prompt: list[int]) -> float:
    from tokenyard.engines import SamplingParams
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def run_llama200m(args) -> int:
    suffix = "_packed" if args.packed else "_packed_int8" if args.packed_int8 else ""
    rec = RunRecorder("quant_prefill" + suffix)
    if not (MODEL / "config.json").is_file():
        print(f"{MODEL} is missing: run `python -m tokenyard.bench.quant_bench` first (it builds the model)")
        return 2
    set_dense(int8=not (args.packed or args.packed_int8), int4=not args.packed)
    g = torch.Generator().manual_seed(0)
    tokens = args.tokens[0]
    prompts = [torch.randint(10, 30000, (tokens,), generator=g).tolist() for _ in range(args.prompts)]
    # Every mode's engine loaded first, then the prompts interleaved across modes: a burst of
    # other work on a shared machine then lands on every mode alike, not on one.
    engines = {mode: engine_for(mode) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i, p in enumerate(prompts):
        for mode, eng in engines.items():
            times[mode].append(1e3 * prefill_s(eng, f"r{i}", p))
    print(f"| mode | {tokens}-token prefill ms |\n| --- | --- |")
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
        rec.write(figures, runs, tokens=tokens, prompts=args.prompts, packed_int8=args.packed_int8 or args.packed,
                  packed_int4=args.packed)
    return 0


# -- per-shape thresholds -------------------------------------------------------------------------

# (model, projection, N, K); SmolLM2-135M: hidden 576, FFN 1536, 9 + 2 * 3 heads of 64, vocab 49152
# (its GGUF head is Q8_0, so int8); the 200M Llama: hidden 1024, FFN 2816, 16 + 2 * 16 heads of 64.
SHAPES = (("smollm2", "qkv_proj", 960, 576), ("smollm2", "o_proj", 576, 576),
          ("smollm2", "gate_up_proj", 3072, 576), ("smollm2", "down_proj", 576, 1536),
          ("llama200m", "qkv_proj", 3072, 1024), ("llama200m", "o_proj", 1024, 1024),
          ("llama200m", "gate_up_proj", 5632, 1024), ("llama200m", "down_proj", 1024, 2816))
ROWS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


def _fastest_ms(fn: Callable[[], object], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return 1e3 * best


def crossover(rows: list[int], packed: list[float], dense: list[float]) -> int | None:
    """Smallest M from which dense is faster at every larger M measured (None: never)."""
    best = None
    for m, p, d in reversed(list(zip(rows, packed, dense))):
        if d >= p:
            break
        best = m
    return best


def run_thresholds(args) -> int:
    from tokenyard.kernels.quant_layout import quantize_int4, quantize_int8
    if args.cpu_time and torch.get_num_threads() != 1:
        raise SystemExit("--cpu-time measures the calling thread: use it with --threads 1")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    rec = RunRecorder("quant_prefill_thresholds" + (f"_t{args.threads}" if args.threads else "")
                      + ("_cpu" if args.cpu_time else ""))
    g = torch.Generator().manual_seed(0)
    layers = {}
    for model, proj, n, k in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.05
        layers[(model, proj, "int4")] = ql.QuantLinear(quantize_int4(w, 32))
        layers[(model, proj, "int8")] = ql.QuantLinear(quantize_int8(w))
        layers[(model, proj, "bf16")] = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    xs = {(k, m): torch.randn(m, k, generator=g).to(torch.bfloat16) for _, _, _, k in SHAPES for m in ROWS}
    samples: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}, load {os.getloadavg()[0]:.2f}", flush=True)
        for model, proj, n, k in SHAPES:
            for m in ROWS:
                x = xs[(k, m)]
                for mode in ("int4", "int8"):
                    lin = layers[(model, proj, mode)]
                    for path, dense in (("packed", False), ("dense", True)):
                        ql.INT8_DENSE_MIN_ROWS = ql.INT4_DENSE_MIN_ROWS = 1 if dense else NEVER
                        samples.setdefault((model, proj, mode, path, m), []).append(
                            _fastest_ms(lambda: lin(x), args.reps, clock))
                lin = layers[(model, proj, "bf16")]
                with torch.no_grad():
                    samples.setdefault((model, proj, "bf16", "dense", m), []).append(
                        _fastest_ms(lambda: lin(x), args.reps, clock))
    set_dense(True, True)
    figures: dict = {"rows": list(ROWS), "shapes": {}}
    runs = [{"model": key[0], "proj": key[1], "mode": key[2], "path": key[3], "m": key[4], "ms": [round(t, 4) for t in v]}
            for key, v in samples.items()]
    print("| model | projection | N x K | mode | crossover M | packed / dense ms at 64 | at 512 | bf16 weights at 512 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, proj, n, k in SHAPES:
        entry = {"n": n, "k": k}
        for mode in ("int4", "int8"):
            med = {path: [statistics.median(samples[(model, proj, mode, path, m)]) for m in ROWS]
                   for path in ("packed", "dense")}
            entry[mode] = {"packed_ms": med["packed"], "dense_ms": med["dense"],
                           "crossover_rows": crossover(list(ROWS), med["packed"], med["dense"])}
            i64, i512 = ROWS.index(64), ROWS.index(512)
            bf = statistics.median(samples[(model, proj, "bf16", "dense", 512)])
            print(f"| {model} | {proj} | {n} x {k} | {mode} | {entry[mode]['crossover_rows']} | "
                  f"{med['packed'][i64]:.3f} / {med['dense'][i64]:.3f} | {med['packed'][i512]:.3f} / "
                  f"{med['dense'][i512]:.3f} | {bf:.3f} |")
        entry["bf16_ms"] = [statistics.median(samples[(model, proj, "bf16", "dense", m)]) for m in ROWS]
        figures["shapes"][f"{model}.{proj}"] = entry
    if not args.no_results:
        rec.write(figures, runs, rounds=args.rounds, reps=args.reps, group_size=32,
                  clock="thread CPU time" if args.cpu_time else "wall")
    return 0


# -- SmolLM2-135M, whole prefills ------------------------------------------------------------------

SMOLLM2_MODES = {"int4": dict(quantization="int4", quant_group_size=32), "int8": dict(quantization="int8"),
                 "bf16": dict(dtype="bfloat16"), "fp32": dict(dtype="float32")}


def _variants() -> list[tuple[str, str, bool]]:
    """(label, engine, dense path on)."""
    out = []
    for name in SMOLLM2_MODES:
        if name in ("int4", "int8"):
            out += [(f"{name}_packed", name, False), (f"{name}_dense", name, True)]
        else:
            out.append((name, name, True))
    return out


def run_smollm2(args) -> int:
    from tokenyard.bench.smollm2_bench import _prompt_of
    from tokenyard.engines import LLM, SamplingParams
    from tokenyard.engines.weights.gguf_models import smollm2_path
    rec = RunRecorder("quant_prefill_smollm2" + (f"_t{args.threads}" if args.threads else ""))
    path = smollm2_path()
    biggest = max(args.tokens)
    # cpu_compile off: the compiled decode graph is never used by a one-token request, and
    # compiling it at start-up would only add minutes to the run
    llms = {name: LLM(str(path), kv_cache_memory=max(64 << 20, biggest * 30 * 2 * 192 * 4 * 2),
                      max_num_batched_tokens=max(biggest, 256), max_model_len=biggest + 64, progress=False,
                      enable_prefix_caching=False, cpu_compile="off", **kw) for name, kw in SMOLLM2_MODES.items()}
    base = _prompt_of(next(iter(llms.values())).tokenizer, biggest)
    if len(base) < biggest:
        raise SystemExit(f"the prompt text gives {len(base)} tokens, fewer than {biggest}")
    one = SamplingParams(temperature=0.0, max_tokens=1)
    variants = _variants()
    samples: dict[tuple[str, int], list[float]] = {}
    loads = []
    for r in range(args.repeats + 1):          # round 0 is the warm-up, not counted
        loads.append(os.getloadavg()[0])
        for n in args.tokens:
            for i, (label, engine, dense) in enumerate(variants):
                set_dense(dense, dense)
                # a distinct first token per run: no two runs share a prefix (caching is off anyway)
                ids = [base[(r * len(variants) + i) % 50 + 1]] + base[1:n]
                t0 = time.perf_counter()
                llms[engine].generate([ids], one, use_tqdm=False)
                dt = time.perf_counter() - t0
                if r:
                    samples.setdefault((label, n), []).append(n / dt)
        if r:
            print(f"round {r}/{args.repeats} (load {loads[-1]:.2f}), tok/s at {args.tokens}: " + "; ".join(
                f"{label} " + "/".join(f"{samples[(label, n)][-1]:.0f}" for n in args.tokens)
                for label, _, _ in variants), flush=True)
    set_dense(True, True)
    figures: dict = {"tokens": list(args.tokens), "thresholds": {"int8": _SHIPPED[0], "int4": _SHIPPED[1]},
                     "load_avg_1min_per_round": loads, "prefill_tok_s_median": {}}
    header = " | ".join(f"{n} tokens" for n in args.tokens)
    print(f"| mode | {header} |\n| --- |" + " --- |" * len(args.tokens))
    for label, _, _ in variants:
        figures["prefill_tok_s_median"][label] = {str(n): statistics.median(samples[(label, n)]) for n in args.tokens}
        print(f"| {label} | " + " | ".join(f"{figures['prefill_tok_s_median'][label][str(n)]:.0f}"
                                           for n in args.tokens) + " |")
    for n in args.tokens:
        med = {label: figures["prefill_tok_s_median"][label][str(n)] for label, _, _ in variants}
        figures.setdefault("ratios", {})[str(n)] = {
            "int4_dense_vs_packed": med["int4_dense"] / med["int4_packed"],
            "int8_dense_vs_packed": med["int8_dense"] / med["int8_packed"],
            "int4_dense_vs_bf16": med["int4_dense"] / med["bf16"],
            "int8_dense_vs_bf16": med["int8_dense"] / med["bf16"]}
    runs = [{"mode": label, "tokens": n, "prefill_tok_s": [round(v, 1) for v in vals]}
            for (label, n), vals in samples.items()]
    if not args.no_results:
        rec.write(figures, runs, model=path.name, repeats=args.repeats,
                  engines={name: kw for name, kw in SMOLLM2_MODES.items()})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--smollm2", action="store_true", help="SmolLM2-135M prefill tok/s, packed vs dense")
    what.add_argument("--thresholds", action="store_true", help="per-shape packed vs dense micro-benchmark")
    ap.add_argument("--tokens", type=int, nargs="*", default=None,
                    help="prompt lengths (default: 128 512 2048 with --smollm2, 512 otherwise)")
    ap.add_argument("--repeats", type=int, default=5, help="--smollm2: counted rounds")
    ap.add_argument("--rounds", type=int, default=5, help="--thresholds: rounds")
    ap.add_argument("--reps", type=int, default=5, help="--thresholds: calls per round (fastest kept)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--packed-int8", action="store_true", help="int8 always through the packed op (200M Llama)")
    ap.add_argument("--packed", action="store_true", help="int8 and int4 always through the packed op (200M Llama)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="--thresholds with --threads 1: time by the thread's CPU time, not the wall clock "
                         "(robust to other work on a shared machine; the file gets a _cpu suffix)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, 2 here); the results file gets a _t<N> suffix")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/quant_prefill*.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens is None:
        args.tokens = [128, 512, 2048] if args.smollm2 else [512]
    if args.thresholds:
        return run_thresholds(args)
    if args.smollm2:
        return run_smollm2(args)
    return run_llama200m(args)


if __name__ == "__main__":
    raise SystemExit(main())
