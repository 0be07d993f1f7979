"""Pipeline parallelism on this CPU: step time, throughput and the pipeline bubble.

    python -m tokenyard.bench.pipeline_bench                 # all configurations, a 29M-parameter random Llama
    python -m tokenyard.bench.pipeline_bench --configs p1,p2 --seqs 8 --new 16   # a pilot

Configurations (each process runs 1 torch thread; spawned workers take cpu_count / ranks):
    p1      one process, 1 thread                 p1t2    one process, 2 threads
    p2      pipeline_parallel_size=2, micro-batches (up to 2 batches in flight)
    p2sync  pipeline_parallel_size=2, one batch at a time (the micro-batcher's depth set to 1)
    tp2     tensor_parallel_size=2
Workload: --seqs sequences of --prompt random tokens arrive together, each generates --new tokens
(greedy, ignore_eos). Reported per configuration: wall seconds, output tokens/s, batches run,
seconds per batch, seconds per output token of one sequence (the decode cadence), and for
pipelines every stage's busy seconds (its own layers' forward) and idle fraction, 1 - busy / wall
over the measured window: the bubble. Greedy tokens are checked equal to p1's.
Raw output: bench/results/<name>.json (bench/results_io.py); the figures are in bench/RESULTS.md.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

CONFIGS = {
    "p1": dict(threads=1),
    "p1t2": dict(threads=2),
    "p2": dict(threads=1, pipeline_parallel_size=2),
    "p2sync": dict(threads=1, pipeline_parallel_size=2, depth=1),
    "tp2": dict(threads=1, tensor_parallel_size=2),
}


def checkpoint(root: Path, args: argparse.Namespace) -> Path:
    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    name = f"llama-l{args.layers}-h{args.hidden}-v{args.vocab}"
    return build_random_checkpoint(root / name, "llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                   intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                                   num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
                                   max_position_embeddings=1024, seed=9, std=0.02)


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random token ids (the same generator as the engine tests' helper)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def run_config(path: Path, name: str, args: argparse.Namespace) -> tuple[dict, dict[str, list[int]]]:
    from tokenyard.engines import Engine, SamplingParams

    spec = dict(CONFIGS[name])
    threads, depth = spec.pop("threads"), spec.pop("depth", None)
    torch.set_num_threads(threads)
    eng = Engine(path, dtype="float32", kv_cache_memory=256 << 20, max_num_batched_tokens=512, max_num_seqs=64,
                 enable_prefix_caching=False, progress=False, tp_timeout_s=120.0, **spec)
    try:
        if depth is not None:
            eng.micro.depth = depth   # benchmark only: the same engine without overlapping batches
        params = SamplingParams(temperature=0.0, max_tokens=args.new, ignore_eos=True)
        eng.add_request("warm", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        pipeline = getattr(eng.runner, "stage_stats", None) if spec.get("pipeline_parallel_size", 1) > 1 else None
        prompts = random_prompts(args.seqs, args.prompt, args.prompt, args.vocab, seed=3)
        repeats = []
        for k in range(args.repeats):   # same engine, same prompts (prefix caching off: all recomputed)
            if pipeline is not None:
                pipeline()   # reset the stage counters
            steps0 = eng.stats().num_steps
            tokens: dict[str, list[int]] = {}
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                eng.add_request(f"r{k}.{i}", p, params)
            while eng.has_unfinished():
                for out in eng.step():
                    tokens.setdefault(out.request_id.split(".")[1], []).extend(out.new_token_ids)
            wall = time.perf_counter() - t0
            stages = pipeline() if pipeline is not None else []
            batches = eng.stats().num_steps - steps0
            rep = {"wall_s": round(wall, 3), "batches": batches}
            if stages:
                rep["stages"] = [{"rank": r, "busy_s": round(b, 3), "busy_cpu_s": round(c, 3),
                                  "idle_fraction": round(1 - b / w, 3)} for r, (b, w, c) in enumerate(stages)]
                rep["mean_idle_fraction"] = round(sum(1 - b / w for b, w, _ in stages) / len(stages), 3)
            repeats.append(rep)
    finally:
        eng.close()
    med = sorted(repeats, key=lambda r: r["wall_s"])[len(repeats) // 2]   # the median repeat
    out_tokens = sum(len(t) for t in tokens.values())
    run = {"config": name, "threads": threads, **spec, "median_wall_s": med["wall_s"],
           "output_tokens": out_tokens, "tokens_per_s": round(out_tokens / med["wall_s"], 1),
           "batches": med["batches"], "s_per_batch": round(med["wall_s"] / med["batches"], 4),
           "s_per_token_per_seq": round(med["wall_s"] / args.new, 4), "repeats": repeats}
    if "mean_idle_fraction" in med:
        run["mean_idle_fraction"] = med["mean_idle_fraction"]
        run["stage_busy_s"] = [s["busy_s"] for s in med["stages"]]
        run["stage_busy_cpu_s"] = [s["busy_cpu_s"] for s in med["stages"]]
        run["stage_idle_fraction"] = [s["idle_fraction"] for s in med["stages"]]
    print({k: v for k, v in run.items() if k != "repeats"}, flush=True)
    return run, tokens


def main(argv: list[str] | None = None) -> None:
    from tokenyard.bench.results_io import RunRecorder, load_avg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="p1,p1t2,p2,p2sync,tp2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="workload runs per engine; the median is reported")
    ap.add_argument("--checkpoints", type=Path, default=Path("bench/out/pipeline_checkpoints"))
    ap.add_argument("--name", default="pipeline_cpu")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    rec = RunRecorder(args.name)
    path = checkpoint(args.checkpoints, args)
    runs, ref = [], None
    for name in names:
        run, tokens = run_config(path, name, args)
        run["load_avg_after"] = load_avg()
        if ref is None:
            ref = tokens
        run["tokens_equal_first"] = tokens == ref
        runs.append(run)
    by = {r["config"]: r for r in runs}
    figures = {"model": {"layers": args.layers, "hidden": args.hidden, "intermediate": 3 * args.hidden,
                         "vocab": args.vocab},
               "workload": {"seqs": args.seqs, "prompt": args.prompt, "new": args.new}}
    for name, r in by.items():
        figures[f"{name}_tokens_per_s"] = r["tokens_per_s"]
        if "mean_idle_fraction" in r:
            figures[f"{name}_mean_idle_fraction"] = r["mean_idle_fraction"]
    rec.write(figures, runs)


if __name__ == "__main__":
    main()
