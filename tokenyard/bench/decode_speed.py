"""Decode speed of the CPU engine, eager vs compiled (cpu_compile), and what compiling costs at start-up.

    .venv/bin/python -m tokenyard.bench.decode_speed [--only w2 smollm2 start] [--rounds 5] [--steps 48]

- w2: the W2 model (random Llama 30.9M, fp32, vocab 8192; tokenyard/bench/workloads.py), one engine with
  cpu_compile off and one with it on, decode step time at batch 1 (64-token prompt), 32 and 96
  (the first W2 prompts): the median over `--steps` engine steps with every sequence decoding,
  per round; rounds alternate eager and compiled; the figure is the median over rounds.
  Batch-1 tok/s = 1000 / step ms (a step is the whole engine step: schedule, forward, sample).
- w2_step: the C decode step (cpu_decode_step on, up to 32 sequences) against eager and compiled
  (both with the step off) at batches 1, 2, 4, 8, 16 and 32 (64-token prompts): where it stops paying.
- smollm2: SmolLM2-135M-Instruct from its Q4_1 GGUF as the engine serves it: int4 (group 32,
  from the Q4_1 blocks), and the dequantised weights in bf16 and fp32; batch-1 decode the same way
  (eager, compiled, and for the fp32-activation modes the C decode step).
- attention: one layer's decode attention over a paged cache (W2 shapes: 8 heads, 2 KV heads,
  head_dim 64, 16-token blocks scattered over the cache), batch 1 at 100 and 500 keys, batch 32 and
  96 at contexts 48-511: the eager engine path (gather whole blocks, SDPA), and under torch.compile
  the engine's compiled path (gather, two batched matmuls) and a fused form that reads K/V in place
  (the gather folded into the reductions' loads); fastest of `--reps` calls per round, median of rounds.
- start: time to a ready engine in a fresh process (`LLM(...)` returns), with cpu_compile on and
  an empty inductor cache (cold), again with that cache (warm), and with cpu_compile off; the
  compile share is the runner's own measure of its warm-up.

The machine is shared: the load average is recorded before and after (bench/results_io.py) and
each section prints its per-round values. Writes bench/results/decode_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenyard.bench.kernel_micro import best_ms
from tokenyard.bench.results_io import RunRecorder, load_avg

ROOT = Path(__file__).resolve().parents[2]
W2_DIR = ROOT / "bench" / "out" / "w2-llama-30m"
W2_OPTIONS = dict(dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128, max_num_batched_tokens=2048,
                  enable_prefix_caching=False)
SMOLLM2_MODES = {"int4_from_q4_1": dict(quantization="int4", quant_group_size=32, dtype="float32"),
                 "dequantised_bf16": dict(quantization="none", dtype="bfloat16"),
                 "dequantised_fp32": dict(quantization="none", dtype="float32")}
SMOLLM2_OPTIONS = dict(kv_cache_memory=256 << 20, max_num_seqs=32, max_num_batched_tokens=1024,
                       enable_prefix_caching=False)


def _w2_model() -> Path:
    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    from tokenyard.bench.workloads import W2_MODEL
    return build_random_checkpoint(W2_DIR, "llama", seed=0, std=0.05, **W2_MODEL)


def decode_step_ms(llm, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of one engine step with every prompt decoding
    (prefill done first). With one torch thread the CPU time is the step's cost without the time
    spent waiting for a core, which is what a loaded machine adds."""
    from tokenyard.engines import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"d{i}", p, params)
    while engine.scheduler.waiting or engine._inbox.num_new or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    engine.step()
    ts, cs = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    for i in range(len(prompts)):
        engine.abort(f"d{i}")
    while engine.has_unfinished():
        engine.step()
    return 1e3 * statistics.median(ts), 1e3 * statistics.median(cs)


def interleaved(llms: dict, cases: dict[str, list[list[int]]], rounds: int, steps: int, tag: str) -> tuple[dict, list]:
    runs = []
    for r in range(rounds):
        for case, prompts in cases.items():
            for name, llm in llms.items():
                ms, cpu_ms = decode_step_ms(llm, prompts, steps)
                runs.append({"section": tag, "case": case, "engine": name, "round": r, "step_ms": ms,
                             "step_cpu_ms": cpu_ms, "load_1min": load_avg()[:1]})
                print(f"{tag} {case} {name} round {r}: {ms:.2f} ms/step wall, {cpu_ms:.2f} ms CPU", flush=True)
    figures: dict = {}
    for case in cases:
        for name in llms:
            mine = [x for x in runs if x["case"] == case and x["engine"] == name]
            ms = statistics.median(x["step_ms"] for x in mine)
            cpu_ms = statistics.median(x["step_cpu_ms"] for x in mine)
            figures.setdefault(case, {})[name] = {"step_ms_median": ms, "tok_s": 1e3 * len(cases[case]) / ms,
                                                  "step_cpu_ms_median": cpu_ms}
        if "eager" in llms and "compiled" in llms:
            e, c = figures[case]["eager"], figures[case]["compiled"]
            figures[case]["speedup"] = e["step_ms_median"] / c["step_ms_median"]
            figures[case]["speedup_cpu_time"] = e["step_cpu_ms_median"] / c["step_cpu_ms_median"]
    return figures, runs


def bench_w2(rounds: int, steps: int) -> tuple[dict, list]:
    from tokenyard.bench.workloads import w2
    from tokenyard.engines import LLM
    path = _w2_model()
    llms = {name: LLM(path, progress=False, cpu_compile=mode, cpu_decode_step="off", **W2_OPTIONS)
            for name, mode in (("eager", "off"), ("compiled", "on"))}
    prompts = [r.prompt_token_ids for r in w2(96)]
    cases = {"batch1": [prompts[0][:64]], "batch32": prompts[:32], "batch96": prompts}
    return interleaved(llms, cases, rounds, steps, "w2")


STEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 96)


def bench_w2_step(rounds: int, steps: int) -> tuple[dict, list]:
    """The C decode step (cpu_decode_step on, taking every batch up to 32) against eager and the
    compiled graph at small batches: where the step stops paying sets cpu_decode_step_max_batch."""
    from tokenyard.bench.workloads import w2
    from tokenyard.engines import LLM
    path = _w2_model()
    llms = {"eager": LLM(path, progress=False, cpu_compile="off", cpu_decode_step="off", **W2_OPTIONS),
            "compiled": LLM(path, progress=False, cpu_compile="on", cpu_decode_step="off", **W2_OPTIONS),
            "c_step": LLM(path, progress=False, cpu_compile="off", cpu_decode_step="on", cpu_decode_step_max_batch=128,
                          **W2_OPTIONS)}
    prompts = [r.prompt_token_ids[:64] for r in w2(96)]
    figures, runs = interleaved(llms, {f"batch{n}": prompts[:n] for n in STEP_BATCHES}, rounds, steps, "w2 step")
    for case in figures.values():
        case["step_vs_compiled"] = case["compiled"]["step_ms_median"] / case["c_step"]["step_ms_median"]
        case["step_vs_eager"] = case["eager"]["step_ms_median"] / case["c_step"]["step_ms_median"]
    return figures, runs


def bench_smollm2(rounds: int, steps: int, modes: list[str]) -> tuple[dict, list]:
    from tokenyard.engines import LLM
    from tokenyard.engines.weights.gguf_models import smollm2_path
    path = smollm2_path()
    figures, runs = {}, []
    for mode in modes:
        llms = {name: LLM(str(path), progress=False, cpu_compile=c, cpu_decode_step=st, **SMOLLM2_OPTIONS,
                          **SMOLLM2_MODES[mode])
                for name, c, st in (("eager", "off", "off"), ("compiled", "on", "off"), ("c_step", "off", "on"))
                if st == "off" or SMOLLM2_MODES[mode]["dtype"] == "float32"}
        words = ("the lighthouse keeper watched the grey sea while ships passed slowly " * 20).split()
        prompt = next(iter(llms.values())).tokenizer.encode(" ".join(words), add_special_tokens=False)[:64]
        f, r = interleaved(llms, {"batch1": [prompt]}, rounds, steps, f"smollm2 {mode}")
        figures[mode], runs = f, runs + r
        del llms
    return figures, runs


def _fused_in_place(q, k_cache, v_cache, tables, lens, block_size: int, scale: float):
    """Decode attention written so that inductor folds the block-table gather into the loads of
    its reductions: no gathered copy of K or V is made."""
    import torch
    batch, heads, hd = q.shape
    kvh = k_cache.shape[0]
    length = tables.shape[1] * block_size
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(batch, length)
    k, v = k_cache[:, slots], v_cache[:, slots]                           # folded into the loads below
    qg = q.view(batch, kvh, heads // kvh, hd).transpose(0, 1)
    s = (qg[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1) * scale       # [kvh, B, g, L]
    valid = torch.arange(length)[None, :] < lens[:, None]
    p = torch.softmax(s.masked_fill(~valid[None, :, None, :], float("-inf")), -1)
    o = (p[..., None] * v[:, :, None, :, :]).sum(-2)                       # [kvh, B, g, hd]
    return o.transpose(0, 1).reshape(batch, heads, hd)


def bench_attention(rounds: int, reps: int) -> tuple[dict, list]:
    import torch

    from tokenyard.kernels import paged_attention_torch as tp
    heads, kvh, hd, bs, num_blocks = 8, 2, 64, 16, 96 * 40
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(kvh, num_blocks * bs, hd, generator=g), torch.randn(kvh, num_blocks * bs, hd, generator=g)
    compiled = torch.compile(tp.decode_attention, fullgraph=True, dynamic=True)
    fused = torch.compile(_fused_in_place, fullgraph=True, dynamic=True)
    cases = {"batch1_ctx100": (1, 100, 100), "batch1_ctx500": (1, 500, 500), "batch32_ctx48-511": (32, 48, 511),
             "batch96_ctx48-511": (96, 48, 511)}
    runs, figures = [], {}
    for case, (b, lo, hi) in cases.items():
        lens = torch.randint(lo, hi + 1, (b,), generator=g)
        pool = torch.randperm(num_blocks, generator=g)
        width = max(2, -(-int(lens.max()) // bs))
        table = pool[:b * width].view(b, width).clone()
        tables = [row[:-(-n // bs)] for row, n in zip(table.tolist(), lens.tolist())]
        q = torch.randn(b, heads, hd, generator=g)

        # The plan (and its gather indices) is built once per step and shared by every layer.
        plan = tp.TorchAttentionPlan.build([1] * b, lens.tolist(), tables, bs)

        def eager():
            return tp.paged_attention(q, k_cache, v_cache, plan, 0.125)

        variants = {"eager: plan + gather + SDPA": eager,
                    "compiled: gather + 2 bmm (engine)": lambda: compiled(q, k_cache, v_cache, table, lens, bs, 0.125),
                    "compiled: fused, K/V read in place": lambda: fused(q, k_cache, v_cache, table, lens, bs, 0.125)}
        ref = eager()
        for name, fn in variants.items():
            err = (fn() - ref).abs().max().item()
            assert err < 1e-4, (case, name, err)
        for r in range(rounds):
            for name, fn in variants.items():
                runs.append({"section": "attention", "case": case, "variant": name, "round": r,
                             "ms": best_ms(fn, reps)})
        figures[case] = {name: statistics.median(x["ms"] for x in runs if x["case"] == case and x["variant"] == name)
                         for name in variants}
        print(f"attention {case}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in figures[case].items()), flush=True)
    return figures, runs


_START_CHILD = """
import json, sys, time
t0 = time.perf_counter()
from tokenyard.engines import LLM
kw = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], progress=False, **kw)
ready = time.perf_counter() - t0
c = llm.engine.runner.compiled
print(json.dumps({"ready_s": ready, "compile_s": c.compile_seconds if c else 0.0}))
"""


def _start_once(path: Path, kw: dict, cache: str) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", _START_CHILD, str(path), json.dumps(kw)], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_start(models: dict[str, tuple[Path, dict]]) -> tuple[dict, list]:
    figures, runs = {}, []
    for name, (path, kw) in models.items():
        with tempfile.TemporaryDirectory(prefix="tokenyard-inductor-") as cache:
            row = {"model": name,
                   "eager": _start_once(path, {**kw, "cpu_compile": "off"}, cache),
                   "cold": _start_once(path, {**kw, "cpu_compile": "on"}, cache),
                   "warm": _start_once(path, {**kw, "cpu_compile": "on"}, cache),
                   "load_1min": load_avg()[:1]}
        runs.append(row)
        figures[name] = {k: row[k] for k in ("eager", "cold", "warm")}
        print(f"start {name}: {json.dumps(figures[name])}", flush=True)
    return figures, runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["w2", "w2_step", "smollm2", "attention", "start"],
                    choices=["w2", "w2_step", "smollm2", "attention", "start"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--smollm2-modes", nargs="*", default=list(SMOLLM2_MODES), choices=list(SMOLLM2_MODES))
    ap.add_argument("--start-models", nargs="*", default=["w2_fp32", "smollm2_int4"],
                    choices=["w2_fp32", "smollm2_int4"])
    ap.add_argument("--name", default="decode_speed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own, 2 here)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    rec = RunRecorder(args.name)
    figures: dict = {}
    runs: list = []
    if "w2" in args.only:
        figures["w2"], r = bench_w2(args.rounds, args.steps)
        runs += r
    if "w2_step" in args.only:
        figures["w2_step"], r = bench_w2_step(args.rounds, args.steps)
        runs += r
    if "smollm2" in args.only:
        figures["smollm2"], r = bench_smollm2(args.rounds, args.steps, args.smollm2_modes)
        runs += r
    if "attention" in args.only:
        figures["attention"], r = bench_attention(args.rounds, args.reps)
        runs += r
    if "start" in args.only:
        from tokenyard.engines.weights.gguf_models import smollm2_path
        models = {"w2_fp32": (_w2_model(), W2_OPTIONS),
                  "smollm2_int4": (smollm2_path(), {**SMOLLM2_OPTIONS, **SMOLLM2_MODES["int4_from_q4_1"]})}
        figures["start"], r = bench_start({k: v for k, v in models.items() if k in args.start_models})
        runs += r
    print(json.dumps(figures, indent=1))
    rec.write(figures, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
