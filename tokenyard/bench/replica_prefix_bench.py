"""Cache-aware vs round-robin replica choice on a prefix-heavy workload (issue 16).

Two replica processes (`tokenyard engine serve`, real demo-large engines, one torch thread each)
and the gateway's ReplicaPool driving them over HTTP exactly as a gateway does (the HTTP edge,
keys and limits are left out: they do not depend on the policy). The workload: `--prefixes`
distinct system prompts of `--system-tokens` tokens, each followed by `--turns` short user turns
(`--user-tokens`), shuffled, `--concurrency` requests at once, `--max-tokens` output tokens each.
Each replica's KV cache is sized (`--kv-blocks`) to hold about half of the system prompts, as a
fleet whose working set exceeds one replica's cache: cache-aware routing partitions the prefixes
between the replicas, round robin makes both hold (and evict) all of them.

Each policy runs on its own cache salt, so it starts from a cold cache on both replicas.
Reported per policy: the prefix-cache hit rate (cached prompt tokens / prompt tokens, from the
requests' usage and, as a check, from the replicas' stats), requests/s and output tokens/s.

    python -m tokenyard.bench.replica_prefix_bench [--prefixes 16 --turns 16 --concurrency 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replicas(n: int, kv_blocks: int, workdir: Path) -> list[tuple[subprocess.Popen, str]]:
    import torch

    from tokenyard.engines.model.kv_cache import bytes_per_block
    from tokenyard.engines.model.model_config import ModelConfig
    model = ROOT / "models" / "demo-large"
    per_block = bytes_per_block(ModelConfig.from_dir(model), 16, torch.float32)   # dtype auto: float32 on CPU
    cfg = workdir / "replica.yaml"
    cfg.write_text(yaml.safe_dump({"engines": {"demo-large": {
        "type": "torch", "model": str(model), "kv_cache_memory": per_block * kv_blocks, "max_num_seqs": 16}}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = []
    for i in range(n):
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "engine", "serve", "--engine", "demo-large",
                                 "--port", str(port), "--config", str(cfg)], cwd=ROOT, env=env,
                                stdout=(workdir / f"r{i}.log").open("wb"), stderr=subprocess.STDOUT)
        out.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + 120
    for proc, url in out:
        while True:
            try:
                with urllib.request.urlopen(url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica {url} did not start; see {workdir}")
            time.sleep(0.2)
    return out


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = 1900                                   # demo-large has 1962 ids; stay clear of the special ones
    systems = [[rng.randrange(10, vocab) for _ in range(args.system_tokens)] for _ in range(args.prefixes)]
    prompts = [s + [rng.randrange(10, vocab) for _ in range(args.user_tokens)]
               for s in systems for _ in range(args.turns)]
    rng.shuffle(prompts)
    return prompts


async def run_policy(policy: str, urls: list[str], prompts: list[list[int]], args) -> dict:
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.gateway.backends.remote_engine import RemoteEngine
    from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
    from tokenyard.gateway.config.replica_config import PoolConfig

    cfg = PoolConfig(policy=policy, health_interval_s=5.0, affinity_weight=args.affinity_weight)
    pool = ReplicaPool("demo-large", [Replica(u, RemoteEngine(u, "demo-large"), cfg, remote=True) for u in urls],
                       cfg)
    await pool.start()
    before = [r.engine.stats().prefix_cache_hit_tokens for r in pool.replicas]
    salt = f"bench-{policy}-{time.time_ns()}"          # a cold cache for this run
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    queue = list(enumerate(prompts))
    prompt_tokens = cached = out_tokens = 0

    async def worker() -> None:
        nonlocal prompt_tokens, cached, out_tokens
        while queue:
            i, ids = queue.pop(0)
            stream = pool.add_request(f"{policy}-{i}", ids, params, cache_salt=salt)
            async for out in stream:
                out_tokens += len(out.new_token_ids)
                if out.finished:
                    assert out.finish_reason == "length", out
                    prompt_tokens += out.num_prompt_tokens
                    cached += out.num_cached_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - t0
    for r in pool.replicas:
        await r.engine.refresh_stats()
    after = [r.engine.stats().prefix_cache_hit_tokens for r in pool.replicas]
    result = {"policy": policy, "requests": len(prompts), "seconds": round(elapsed, 2),
              "prefix_hit_rate": round(cached / prompt_tokens, 4),
              "prefix_hit_rate_from_replica_stats": round((sum(after) - sum(before)) / prompt_tokens, 4),
              "requests_per_s": round(len(prompts) / elapsed, 2), "output_tokens_per_s": round(out_tokens / elapsed, 1),
              "per_replica_requests": [r.chosen for r in pool.replicas],
              "affinity_hits": sum(r.affinity_hits for r in pool.replicas)}
    await pool.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    from tokenyard.gateway.config.replica_config import PoolConfig
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-tokens", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=176, help="KV blocks per replica (16 tokens each)")
    ap.add_argument("--affinity-weight", type=float, default=PoolConfig().affinity_weight,
                    help="replica_pool.affinity_weight for cache_aware")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="round_robin,cache_aware")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/replica_prefix.json")
    args = ap.parse_args(argv)
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("replica_prefix")
    args_keys = ("prefixes", "turns", "system_tokens", "user_tokens", "max_tokens", "concurrency", "kv_blocks",
                 "affinity_weight", "seed")
    prompts = workload(args)
    workdir = Path(tempfile.mkdtemp(prefix="replica-bench-"))
    replicas = start_replicas(2, args.kv_blocks, workdir)
    try:
        results = [asyncio.run(run_policy(p, [u for _, u in replicas], prompts, args))
                   for p in args.policies.split(",")]
    finally:
        for proc, _ in replicas:
            proc.terminate()
        for proc, _ in replicas:
            proc.wait(30)
    doc = {"workload": {k: getattr(args, k) for k in args_keys},
           "replicas": 2, "engine": "demo-large (torch, CPU, 1 thread per replica)", "results": results}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if not args.no_results:
        rec.write({"workload": doc["workload"], "replicas": 2, "engine": doc["engine"]}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
