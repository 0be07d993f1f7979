"""What the gateway adds on top of the engine, measured like a user would (issue 9).

1. Added latency: one sequential client sends one-token chat requests (max_tokens=1) to the mock
   engine (no delays) through the gateway over HTTP (aiohttp, keep-alive), and the same number
   of one-token requests straight to the AsyncEngine in-process; the difference of the p50 and
   p99 latencies is what the gateway adds (HTTP parsing, validation, auth from the key cache,
   the rate-limit reservation in Redis (one Lua round trip) and its refund, admission, chat
   template and tokenisation, detokenisation, JSON, metrics, access-log bookkeeping).
   `--no-limits` turns the Redis rate limits off, to see what they add on their own.
2. Throughput: 32 concurrent clients (aiohttp) against one gateway worker, requests/s.
3. Event-loop responsiveness: GET /health latency (p50, p99) every 20 ms while 32 clients keep
   the real demo-large torch engine saturated (issue 9: p99 <= 20 ms).

The gateway runs in a separate process (one uvicorn worker), so the client's CPU use does not
slow its event loop; on a 2-core machine they still share the cores.

`--workers 1,2 --rounds 2` measures 1 and 2 (server.workers) in the same run, interleaved: with
more than one worker the mock engine steps in one engine core shared by the workers (with one, it
stays in-process as by default), and the figures go to bench/results/gateway_overhead_workers.json.

    .venv/bin/python -m tokenyard.bench.gateway_overhead [--requests 2000] [--seconds 10] [--concurrency 32]
    .venv/bin/python -m tokenyard.bench.gateway_overhead --workers 1,2 --rounds 2 --health-seconds 0
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from tokenyard.bench.serve_launch import free_port, spawn_gateway

ROOT = Path(__file__).resolve().parent.parent.parent
KEY = "bench-key"
BODY = {"model": "mock", "max_tokens": 1, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def direct_latencies(n: int) -> list[float]:
    """The baseline: the same request straight into the AsyncEngine (tokenised once up front)."""
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.runtime.async_engine import AsyncEngine
    from tokenyard.engines.serving.mock_engine import MockEngine
    from tokenyard.engines.text.chat_template import apply_chat_template

    engine = MockEngine(ROOT / "models" / "demo-small")
    ae = AsyncEngine(engine, "mock")
    await ae.start()
    ids = engine.tokenizer.encode(apply_chat_template(engine.tokenizer, BODY["messages"]), add_special_tokens=False)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        stream = ae.add_request(f"d{i}", ids, SamplingParams(max_tokens=1, temperature=0))
        async for _ in stream:
            pass
        out.append(time.perf_counter() - t0)
    await ae.stop()
    return out


async def gateway_latencies(url: str, n: int) -> list[float]:
    headers = {"Authorization": f"Bearer {KEY}"}
    out = []
    async with aiohttp.ClientSession(headers=headers) as session:
        for i in range(n):
            t0 = time.perf_counter()
            async with session.post(url, json=BODY) as resp:
                body = await resp.read()
            out.append(time.perf_counter() - t0)
            assert resp.status == 200, body
    return out


async def throughput(url: str, seconds: float, concurrency: int) -> tuple[float, int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    done = errors = 0
    stop = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop:
            async with session.post(url, json=BODY) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
                else:
                    errors += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        return done / (time.perf_counter() - t0), errors


async def health_under_load(base: str, seconds: float, concurrency: int) -> tuple[list[float], int]:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "demo-large", "max_tokens": 64, "temperature": 0,
            "messages": [{"role": "user", "content": "Reverse the order of these words: red sun blue moon"}]}
    stop = time.perf_counter() + seconds
    served = 0

    async def load(session: aiohttp.ClientSession) -> None:
        nonlocal served
        while time.perf_counter() < stop:
            async with session.post(base + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                served += resp.status == 200

    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=concurrency + 1)) as session:
        tasks = [asyncio.ensure_future(load(session)) for _ in range(concurrency)]
        await asyncio.sleep(1.0)  # let the engine fill up
        lat = []
        while time.perf_counter() < stop - 0.5:
            t0 = time.perf_counter()
            async with session.get(base + "/health") as resp:
                await resp.read()
            lat.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
        await asyncio.gather(*tasks)
    return lat, served


PREFIX = f"bench:overhead:{os.getpid()}:"


def start_gateway(port: int, engine: str = "mock", limits: bool = True, workers: int = 1) -> subprocess.Popen:
    cfg = ROOT / "bench" / "out" / f"gateway_overhead_{engine}.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    engines = {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}
    if engine != "mock":
        engines = {engine: {"type": "torch", "model": str(ROOT / "models" / engine), "kv_cache_memory": 128 << 20}}
    # Limits on (high enough never to refuse): every request pays the reservation and the refund.
    cfg.write_text(json.dumps({"server": {"host": "127.0.0.1", "port": port, "access_log": False, "workers": workers},
                               "redis_prefix": PREFIX,
                               "rate_limits": {"enabled": limits, "requests": 10**9, "tokens": 10**12},
                               "engines": engines}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": KEY, "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")}
    return spawn_gateway(cfg, env, port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests per side")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the throughput run")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--health-seconds", type=float, default=8.0, help="0 skips the /health-under-load run")
    ap.add_argument("--no-limits", action="store_true", help="rate limits off (auth and admission stay on)")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/gateway_overhead.json")
    ap.add_argument("--workers", help="comma-separated server.workers values to compare in this run (e.g. 1,2)")
    ap.add_argument("--rounds", type=int, default=1, help="with --workers: interleaved rounds of each value")
    args = ap.parse_args()
    if args.workers:
        compare_workers(args)
        return
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("gateway_overhead")
    port = free_port()
    proc = start_gateway(port, limits=not args.no_limits)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        asyncio.run(gateway_latencies(url, 200))            # warm-up
        gw = asyncio.run(gateway_latencies(url, args.requests))
        direct = asyncio.run(direct_latencies(args.requests))
        rps, errors = asyncio.run(throughput(url, args.seconds, args.concurrency))
    finally:
        proc.terminate()
        proc.wait(30)
    health: list[float] = []
    served = 0
    if args.health_seconds > 0:
        proc = start_gateway(port, "demo-large")
        try:
            health, served = asyncio.run(health_under_load(f"http://127.0.0.1:{port}", args.health_seconds,
                                                           args.concurrency))
        finally:
            proc.terminate()
            proc.wait(30)
    ms = 1000.0
    result = {
        "requests": args.requests,
        "gateway_p50_ms": _pct(gw, 0.5) * ms, "gateway_p99_ms": _pct(gw, 0.99) * ms,
        "direct_p50_ms": _pct(direct, 0.5) * ms, "direct_p99_ms": _pct(direct, 0.99) * ms,
        "added_p50_ms": (_pct(gw, 0.5) - _pct(direct, 0.5)) * ms,
        "added_p99_ms": (_pct(gw, 0.99) - _pct(direct, 0.99)) * ms,
        "gateway_mean_ms": statistics.fmean(gw) * ms,
        "concurrency": args.concurrency, "throughput_rps": rps, "throughput_errors": errors,
        "rate_limits": not args.no_limits,
    }
    if health:
        result.update(health_samples=len(health), health_p50_ms=_pct(health, 0.5) * ms,
                      health_p99_ms=_pct(health, 0.99) * ms, saturated_requests_served=served)
    _cleanup_redis()
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}, indent=2))
    if not args.no_results:
        rec.write(result, [], seconds=args.seconds, health_seconds=args.health_seconds)


def compare_workers(args: argparse.Namespace) -> None:
    """Added latency and 32-client throughput for each server.workers value, interleaved over rounds."""
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("gateway_overhead_workers")
    counts = [int(w) for w in args.workers.split(",")]
    direct = asyncio.run(direct_latencies(args.requests))
    runs = []
    ms = 1000.0
    for rnd in range(args.rounds):
        for workers in counts:
            port = free_port()
            proc = start_gateway(port, limits=not args.no_limits, workers=workers)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                time.sleep(2.0 if workers > 1 else 0.0)         # /ready answers once the first worker is up
                asyncio.run(throughput(url, 2.0, args.concurrency))   # warm-up: every worker, every connection
                gw = asyncio.run(gateway_latencies(url, args.requests))
                rps, errors = asyncio.run(throughput(url, args.seconds, args.concurrency))
            finally:
                proc.terminate()
                proc.wait(60)
            runs.append({"round": rnd, "workers": workers, "gateway_p50_ms": _pct(gw, 0.5) * ms,
                         "gateway_p99_ms": _pct(gw, 0.99) * ms,
                         "added_p50_ms": (_pct(gw, 0.5) - _pct(direct, 0.5)) * ms,
                         "added_p99_ms": (_pct(gw, 0.99) - _pct(direct, 0.99)) * ms,
                         "throughput_rps": rps, "throughput_errors": errors})
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in runs[-1].items()}), flush=True)
    figures: dict = {"direct_p50_ms": _pct(direct, 0.5) * ms, "direct_p99_ms": _pct(direct, 0.99) * ms,
                     "concurrency": args.concurrency, "requests": args.requests, "rate_limits": not args.no_limits}
    for workers in counts:
        mine = [r for r in runs if r["workers"] == workers]
        figures[f"workers_{workers}"] = {k: statistics.median(r[k] for r in mine)
                                         for k in ("added_p50_ms", "added_p99_ms", "throughput_rps")}
    _cleanup_redis()
    print(json.dumps(figures, indent=1))
    if not args.no_results:
        rec.write(figures, runs, seconds=args.seconds, rounds=args.rounds)


def _cleanup_redis() -> None:
    import redis
    client = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    names = list(client.scan_iter(match=PREFIX + "*"))
    if names:
        client.delete(*names)
    client.close()


if __name__ == "__main__":
    main()
