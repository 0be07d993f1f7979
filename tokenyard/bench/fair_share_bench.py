"""Weighted fair share under saturation (issue 30): do tenants get tokens in proportion to weight?

A `tokenyard serve` process runs one mock engine with `--slots` requests at once and a policy
whose tenants have weights (default heavy 2, light 1). Each tenant runs `--clients` closed-loop
clients (each sends its next request when the last one ends), far more than the engine's slots,
so both tenants always have requests queued: the admission queue alone decides who is served.
Every request asks for a random max_tokens in [--min-tokens, --max-tokens] (the mock engine
generates exactly that many), so shares in tokens and shares in requests differ.

Reported per tenant, over the measured window after a warm-up: completion tokens served and
requests served; the heavy/light token ratio against the weight ratio (goal within +-10%); and
the same run with equal weights as the control (ratio ~1). TTFT p50/p99 per tenant shows what
the weight costs the other tenant in waiting.

    .venv/bin/python -m tokenyard.bench.fair_share_bench [--seconds 20] [--weights 2,1]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import subprocess
import time
from pathlib import Path

import aiohttp

from tokenyard.bench.admission_overload import _pct, cleanup
from tokenyard.bench.serve_launch import free_port, spawn_gateway

ROOT = Path(__file__).resolve().parent.parent.parent
MSG = [{"role": "user", "content": "Summarise the weather."}]
TENANTS = ("heavy", "light")


def _policy(weights: tuple[int, int]) -> str:
    return (
        "version: 1\nengines: {small: mock, large: mock2}\n"
        "prices:\n  mock: {input: 0.1, cached_input: 0.05, output: 0.4}\n"
        "  mock2: {input: 1, cached_input: 0.5, output: 4}\n"
        f"tenants:\n  heavy: {{weight: {weights[0]}}}\n  light: {{weight: {weights[1]}}}\n")


def start_gateway(port: int, args: argparse.Namespace, prefix: str, redis_url: str,
                  weights: tuple[int, int]) -> subprocess.Popen:
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    policy = out / f"fair_share_policy_{weights[0]}_{weights[1]}.yaml"
    policy.write_text(_policy(weights))
    engine = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "token_ms": args.token_ms,
              "output_len": 4096, "max_num_seqs": args.slots, "max_sleep_ms": 2}
    cfg = out / "fair_share.yaml"
    cfg.write_text(json.dumps({
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "redis_url": redis_url, "redis_prefix": prefix, "policy": str(policy),
        "rate_limits": {"requests": 1_000_000, "tokens": 1_000_000_000},
        "admission": {"max_running": args.slots, "max_queue": 4096, "max_concurrent_per_tenant": 0,
                      "default_deadline_ms": 600_000},
        "routing": {"small": "mock", "large": "mock2"},
        "engines": {"mock": engine, "mock2": engine}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": "bench-admin-" + secrets.token_hex(8)}
    return spawn_gateway(cfg, env, port)


def make_keys(redis_url: str, prefix: str) -> dict[str, str]:
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    client = redis.Redis.from_url(redis_url)
    store = KeyStore(client, prefix)
    keys = {t: store.create(t, rpm=0, tpm=0, max_concurrent=0)[0] for t in TENANTS}
    client.close()
    return keys


async def client(session: aiohttp.ClientSession, url: str, tenant: str, key: str, stop_at: float,
                 rng: random.Random, lo: int, hi: int, out: list[dict]) -> None:
    while time.perf_counter() < stop_at:
        n = rng.randint(lo, hi)
        body = {"model": "mock", "messages": MSG, "max_tokens": n, "stream": True}
        t0 = time.perf_counter()
        ttft = None
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            if resp.status != 200:
                out.append({"tenant": tenant, "status": resp.status, "end": time.perf_counter()})
                await resp.read()
                continue
            async for _line in resp.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
        out.append({"tenant": tenant, "status": 200, "tokens": n, "ttft": ttft, "end": time.perf_counter()})


async def load(url: str, keys: dict[str, str], args: argparse.Namespace, seed: int) -> tuple[list[dict], float]:
    out: list[dict] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        stop_at = start + args.warmup + args.seconds
        tasks = [client(session, url, t, keys[t], stop_at, random.Random(seed * 1000 + i * 2 + j), args.min_tokens,
                        args.max_tokens, out)
                 for i in range(args.clients) for j, t in enumerate(TENANTS)]
        await asyncio.gather(*tasks)
    return out, start + args.warmup


def summarise(results: list[dict], measured_from: float, weights: tuple[int, int]) -> dict:
    window = [r for r in results if r["end"] >= measured_from]
    by = {}
    for t in TENANTS:
        ok = [r for r in window if r["tenant"] == t and r["status"] == 200]
        by[t] = {"tokens": sum(r["tokens"] for r in ok), "requests": len(ok),
                 "errors": sum(1 for r in window if r["tenant"] == t and r["status"] != 200),
                 "ttft_p50_ms": round(_pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.5) * 1000, 1),
                 "ttft_p99_ms": round(_pct([r["ttft"] for r in ok if r["ttft"] is not None], 0.99) * 1000, 1)}
    ratio = by["heavy"]["tokens"] / max(1, by["light"]["tokens"])
    target = weights[0] / weights[1]
    return {"weights": list(weights), "tenants": by, "token_ratio": round(ratio, 3), "target_ratio": target,
            "error_vs_target": round(ratio / target - 1, 4),
            "request_ratio": round(by["heavy"]["requests"] / max(1, by["light"]["requests"]), 3)}


def run_once(args: argparse.Namespace, weights: tuple[int, int], redis_url: str, seed: int) -> dict:
    prefix = f"bench:fair:{secrets.token_hex(4)}:"
    port = free_port()
    proc = start_gateway(port, args, prefix, redis_url, weights)
    try:
        keys = make_keys(redis_url, prefix)
        results, measured_from = asyncio.run(load(f"http://127.0.0.1:{port}/v1/chat/completions", keys, args, seed))
    finally:
        proc.terminate()
        proc.wait(30)
        cleanup(redis_url, prefix)
    return summarise(results, measured_from, weights)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per run")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--weights", default="2,1", help="heavy,light")
    ap.add_argument("--slots", type=int, default=4, help="requests the mock engine runs at once")
    ap.add_argument("--clients", type=int, default=12, help="closed-loop clients per tenant (> slots: saturated)")
    ap.add_argument("--token-ms", type=float, default=2.0)
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/fair_share.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("fair_share")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    heavy, light = (int(x) for x in args.weights.split(","))
    runs = [run_once(args, (heavy, light), redis_url, seed=1), run_once(args, (1, 1), redis_url, seed=2)]
    for r in runs:
        print(json.dumps(r, indent=1))
    figures = {"weighted": runs[0], "equal_weights_control": runs[1],
               "within_10_percent": abs(runs[0]["error_vs_target"]) <= 0.10}
    if not args.no_results:
        rec.write(figures, [], slots=args.slots, clients_per_tenant=args.clients, token_ms=args.token_ms,
                  max_tokens_range=[args.min_tokens, args.max_tokens], seconds=args.seconds)


if __name__ == "__main__":
    main()
