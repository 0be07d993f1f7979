"""Scheduler benchmarks (issue 5): KV waste, prefix-cache TTFT, prefill stutter, token budget.

    python -m tokenyard.bench.scheduler_bench [--only waste|ttft|stutter|prefill] [--out bench/out/scheduler.json]

- waste: W2's request lengths through the engine (a tiny model: waste depends only on lengths
  and block size); allocated-but-unused KV slots over allocated, summed over every step, for
  paged blocks vs a contiguous reservation per request of prompt + max_tokens (what a
  non-paged server must hold) and of max_model_len.
- ttft: a request with a 2,000-token system prompt (+ 16-token question) on the W2 model,
  prefix cache cold vs warm; median of 5.
- stutter: 16 requests decoding when one 4,000-token prompt arrives; the decoders' worst
  inter-token gap and the long prompt's TTFT, for several max_num_batched_tokens budgets, the
  largest of which takes the whole prompt in one step (no chunking); 3 interleaved rounds, the
  median round per budget.
- prefill: prefill-only throughput (32 W2 prompts, one output token each) at token budgets 512
  and 2048, engines built once and timed in interleaved rounds; median tokens/s.
Raw output: bench/results/scheduler_<section>.json, one per section run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenyard.bench.random_checkpoint import build_random_checkpoint
from tokenyard.bench.workloads import W2_MODEL, w2
from tokenyard.engines import Engine, SamplingParams

LONG_MODEL = dict(W2_MODEL, max_position_embeddings=4608)


def kv_waste(block_size: int = 16) -> dict:
    model = build_random_checkpoint("bench/out/tiny-8k", "llama", vocab_size=8192, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=1, max_position_embeddings=1024)
    reqs = w2()
    eng = Engine(model, kv_cache_memory=1 << 30, block_size=block_size, progress=False, enable_prefix_caching=False)
    for i, r in enumerate(reqs):
        eng.add_request(f"w{i}", r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                                     ignore_eos=True))
    reserve = {f"w{i}": len(r.prompt_token_ids) + r.output_len for i, r in enumerate(reqs)}
    alloc = used = contiguous = max_len = 0
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            alloc += len(seq.block_table) * block_size
            used += seq.num_computed_tokens
            contiguous += reserve[seq.request_id]
            max_len += eng.max_model_len
    return {"block_size": block_size, "paged_waste": 1 - used / alloc,
            "contiguous_prompt_plus_max_tokens_waste": 1 - used / contiguous,
            "contiguous_max_model_len_waste": 1 - used / max_len, "max_model_len": eng.max_model_len}


def _first_token_time(eng: Engine, rid: str, prompt: list[int], salt: str | None) -> tuple[float, int]:
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1), cache_salt=salt)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.new_token_ids:
                dt = time.perf_counter() - t0
                while eng.has_unfinished():
                    eng.step()
                return dt, out.num_cached_tokens


def prefix_ttft(runs: int = 5) -> dict:
    model = build_random_checkpoint("bench/out/w2-llama-30m-long", "llama", seed=0, std=0.05, **LONG_MODEL)
    eng = Engine(model, kv_cache_memory=1 << 30, progress=False)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 8192, (2000,), generator=g).tolist()
    questions = [torch.randint(3, 8192, (16,), generator=g).tolist() for _ in range(runs * 2 + 1)]
    _first_token_time(eng, "warmup", system[:200] + questions[0], "warmup")
    cold, warm = [], []
    for i in range(runs):
        # A fresh salt is a cold cache for the same text; then the same salt again is warm.
        dt, cached = _first_token_time(eng, f"cold{i}", system + questions[2 * i + 1], f"s{i}")
        assert cached == 0
        cold.append(dt)
        dt, cached = _first_token_time(eng, f"warm{i}", system + questions[2 * i + 2], f"s{i}")
        assert cached == 2000 - 2000 % 16
        warm.append(dt)
    return {"system_prompt_tokens": 2000, "cold_ttft_s": cold, "warm_ttft_s": warm,
            "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm),
            "speedup": statistics.median(cold) / statistics.median(warm)}


def stutter(budgets=(256, 512, 1024, 2048, 4112), rounds: int = 3) -> list[dict]:
    """Rounds interleave the budgets; each budget's row is its median-worst-gap round (one
    burst of other work on a shared machine otherwise decides a single-shot worst gap)."""
    runs: dict[int, list[dict]] = {b: [] for b in budgets}
    for _ in range(rounds):
        for row in _stutter_round(budgets):
            runs[row["max_num_batched_tokens"]].append(row)
    rows = []
    for b, rs in runs.items():
        ranked = sorted(rs, key=lambda r: r["worst_gap_s"])
        rows.append({**ranked[len(ranked) // 2], "rounds": len(rs), "worst_gap_s_runs": [r["worst_gap_s"] for r in rs],
                     "long_prompt_ttft_s_runs": [r["long_prompt_ttft_s"] for r in rs]})
    return rows


def _stutter_round(budgets) -> list[dict]:
    model = build_random_checkpoint("bench/out/w2-llama-30m-long", "llama", seed=0, std=0.05, **LONG_MODEL)
    g = torch.Generator().manual_seed(1)
    decoders = [torch.randint(3, 8192, (64,), generator=g).tolist() for _ in range(16)]
    long_prompt = torch.randint(3, 8192, (4000,), generator=g).tolist()
    rows = []
    for budget in budgets:
        eng = Engine(model, kv_cache_memory=1 << 30, max_num_batched_tokens=budget, progress=False,
                     enable_prefix_caching=False)
        for i, p in enumerate(decoders):
            eng.add_request(f"d{i}", p, SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting \
                or eng._inbox.num_new:
            eng.step()
        for _ in range(3):
            eng.step()
        last = {f"d{i}": time.perf_counter() for i in range(16)}
        worst, gaps = 0.0, []
        t0 = time.perf_counter()
        eng.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
        ttft = None
        while ttft is None or len(gaps) < 16 * 5:
            for out in eng.step():
                now = time.perf_counter()
                if out.request_id == "long":
                    ttft = now - t0
                elif out.new_token_ids:
                    gap = now - last[out.request_id]
                    last[out.request_id] = now
                    worst = max(worst, gap)
                    gaps.append(gap)
        rows.append({"max_num_batched_tokens": budget, "chunked": budget < 4016, "worst_gap_s": worst,
                     "median_gap_s": statistics.median(gaps), "long_prompt_ttft_s": ttft})
        print(rows[-1], flush=True)
    return rows


def prefill_throughput(budgets=(512, 2048), num_prompts: int = 32, rounds: int = 3) -> dict:
    model = build_random_checkpoint("bench/out/w2-llama-30m", "llama", seed=0, std=0.05, **W2_MODEL)
    prompts = [r.prompt_token_ids for r in w2(num_prompts, vocab_size=W2_MODEL["vocab_size"])]
    tokens = sum(len(p) for p in prompts)
    engines = {b: Engine(model, dtype="float32", kv_cache_memory=256 << 20, max_num_seqs=128,
                         max_num_batched_tokens=b, progress=False, enable_prefix_caching=False) for b in budgets}

    def once(eng: Engine, tag: str) -> float:
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            eng.add_request(f"{tag}-{i}", p, SamplingParams(temperature=0.0, max_tokens=1))
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t0

    for b, eng in engines.items():      # warm-up: first-call costs out of the timed rounds
        once(eng, f"warm{b}")
    runs: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(rounds):
        for b, eng in engines.items():
            runs[b].append(tokens / once(eng, f"r{r}b{b}"))
        print({b: round(v[-1]) for b, v in runs.items()}, flush=True)
    return {"prompts": num_prompts, "prompt_tokens": tokens, "tokens_per_s_runs": {str(b): v for b, v in runs.items()},
            "tokens_per_s_median": {str(b): statistics.median(v) for b, v in runs.items()}}


SECTIONS = {"waste": ("kv_waste", kv_waste), "ttft": ("prefix_ttft", prefix_ttft), "stutter": ("stutter", stutter),
            "prefill": ("prefill_throughput", prefill_throughput)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=list(SECTIONS), nargs="+")
    ap.add_argument("--out", default="bench/out/scheduler.json")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/scheduler_*.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    out_path = Path(args.out)
    result = json.loads(out_path.read_text()) if out_path.is_file() else {}
    for section, (key, fn) in SECTIONS.items():
        if args.only and section not in args.only:
            continue
        rec = RunRecorder(f"scheduler_{section}")
        result[key] = value = fn()
        print(value, flush=True)
        if not args.no_results:
            if isinstance(value, list):      # stutter: one row per token budget
                figures = {"by_budget": {str(r["max_num_batched_tokens"]): r for r in value}}
                rec.write(figures, value)
            else:
                rec.write(value, [])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
