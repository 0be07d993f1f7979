"""Admission under sustained overload (issue 10): 3x the engine's capacity for 30 s.

A `tokenyard serve` process runs the mock engine with a set service rate: `--slots` requests at
once, each `--output-len` tokens at `--token-ms` per token, so capacity = slots / (output_len x
token_ms) requests per second. An open-loop client (aiohttp, its own process) sends streamed
requests at `--overload` x capacity with x-request-deadline-ms `--deadline-ms`, half from an
interactive tenant and half from a batch tenant, through auth and rate limits in a real Redis.

Reported: statuses; shed replies' latency (p50, p99, max) with their Retry-After present;
admitted requests' TTFT (p50, p99) against the deadline; 5xx other than the intended 503 sheds
(must be 0); throughput served vs capacity.

    .venv/bin/python -m tokenyard.bench.admission_overload [--seconds 30] [--overload 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import aiohttp

from tokenyard.bench.serve_launch import free_port, spawn_gateway

ROOT = Path(__file__).resolve().parent.parent.parent
MSG = [{"role": "user", "content": "What is 2 + 2?"}]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def start_gateway(port: int, args: argparse.Namespace, prefix: str, redis_url: str) -> subprocess.Popen:
    cfg = ROOT / "bench" / "out" / "admission_overload.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps({
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "redis_url": redis_url, "redis_prefix": prefix,
        "rate_limits": {"requests": 1_000_000, "tokens": 1_000_000_000},
        "admission": {"max_running": args.slots, "max_queue": 1024, "max_concurrent_per_tenant": 0},
        "engines": {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "token_ms": args.token_ms,
                             "output_len": args.output_len, "max_num_seqs": args.slots, "max_sleep_ms": 2}}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": "bench-admin-" + secrets.token_hex(8)}
    return spawn_gateway(cfg, env, port)


async def one(session: aiohttp.ClientSession, url: str, key: str, deadline_ms: int) -> dict:
    t0 = time.perf_counter()
    body = {"model": "mock", "messages": MSG, "stream": True}
    headers = {"Authorization": f"Bearer {key}", "x-request-deadline-ms": str(deadline_ms)}
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            data = await resp.read()
            try:
                code = json.loads(data)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = "?"
            return {"status": resp.status, "latency": time.perf_counter() - t0, "code": code, "key": key,
                    "retry_after": "retry-after" in resp.headers and "retry-after-ms" in resp.headers}
        ttft = None
        async for line in resp.content:
            if ttft is None and line.startswith(b"data: ") and b'"content"' in line and b'"content": ""' not in line:
                ttft = time.perf_counter() - t0
        return {"status": 200, "latency": time.perf_counter() - t0, "ttft": ttft, "key": key}


async def load(url: str, keys: list[str], rate: float, seconds: float, deadline_ms: int) -> list[dict]:
    tasks = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        t0 = time.perf_counter()
        i = 0
        while (now := time.perf_counter() - t0) < seconds:
            due = i / rate
            if due > now:
                await asyncio.sleep(due - now)
            tasks.append(asyncio.ensure_future(one(session, url, keys[i % len(keys)], deadline_ms)))
            i += 1
        return list(await asyncio.gather(*tasks, return_exceptions=True))


def make_keys(redis_url: str, prefix: str) -> list[str]:
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    client = redis.Redis.from_url(redis_url)
    store = KeyStore(client, prefix)
    keys = [store.create("interactive-tenant", priority="interactive", rpm=0, tpm=0, max_concurrent=0)[0],
            store.create("batch-tenant", priority="batch", rpm=0, tpm=0, max_concurrent=0)[0]]
    client.close()
    return keys


def cleanup(redis_url: str, prefix: str) -> None:
    import redis
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match=prefix + "*"))
    if names:
        client.delete(*names)
    client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--overload", type=float, default=3.0, help="offered load / capacity")
    ap.add_argument("--slots", type=int, default=8, help="requests the mock engine runs at once")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--token-ms", type=float, default=10.0)
    ap.add_argument("--deadline-ms", type=int, default=1000)
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/admission_overload.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("admission_overload")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    prefix = f"bench:adm:{secrets.token_hex(4)}:"
    capacity = args.slots / (args.output_len * args.token_ms / 1000)
    port = free_port()
    proc = start_gateway(port, args, prefix, redis_url)
    try:
        keys = make_keys(redis_url, prefix)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(load(url, keys, capacity / 2, 2.0, args.deadline_ms))      # warm-up at half capacity
        t0 = time.perf_counter()
        results = asyncio.run(load(url, keys, capacity * args.overload, args.seconds, args.deadline_ms))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(30)
        cleanup(redis_url, prefix)
    errors = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if isinstance(r, dict)]
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    shed = [r for r in done if r["status"] in (429, 503)]
    codes: dict[str, int] = {}
    for r in shed:
        codes[r["code"]] = codes.get(r["code"], 0) + 1
    at_once = [r["latency"] for r in shed if r["code"] != "deadline_exceeded"]
    expired = [r["latency"] for r in shed if r["code"] == "deadline_exceeded"]
    served_by_class = [sum(1 for r in done if r["status"] == 200 and r["key"] == k) for k in keys]
    ok = [r for r in done if r["status"] == 200]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    ms = 1000.0
    out = {
        "offered_rps": round(capacity * args.overload, 1), "capacity_rps": round(capacity, 1),
        "seconds": args.seconds, "deadline_ms": args.deadline_ms, "requests": len(results),
        "statuses": statuses, "client_errors": len(errors),
        "other_5xx": sum(1 for r in done if r["status"] >= 500 and r["status"] != 503),
        "served_rps": round(len(ok) / wall, 1),
        "shed": len(shed), "shed_with_retry_after": sum(1 for r in shed if r["retry_after"]),
        "shed_p50_ms": round(_pct([r["latency"] for r in shed], 0.5) * ms, 2),
        "shed_p99_ms": round(_pct([r["latency"] for r in shed], 0.99) * ms, 2),
        "shed_max_ms": round(max((r["latency"] for r in shed), default=float("nan")) * ms, 2),
        "shed_codes": codes,
        "shed_at_once_p50_ms": round(_pct(at_once, 0.5) * ms, 2),
        "shed_at_once_p99_ms": round(_pct(at_once, 0.99) * ms, 2),
        "expired_in_queue": len(expired),
        "served_interactive": served_by_class[0], "served_batch": served_by_class[1],
        "admitted_ttft_p50_ms": round(_pct(ttft, 0.5) * ms, 1),
        "admitted_ttft_p99_ms": round(_pct(ttft, 0.99) * ms, 1),
        "admitted_ttft_over_deadline": sum(1 for t in ttft if t * ms > args.deadline_ms),
    }
    print(json.dumps(out, indent=2))
    if not args.no_results:
        rec.write(out, [], slots=args.slots, output_len=args.output_len, token_ms=args.token_ms)


if __name__ == "__main__":
    main()
