"""Batch API (issue 30): does a 10,000-line batch hurt interactive users, and how fast does it run?

A `tokenyard serve` process runs one mock engine (time to first token `--ttft-ms`, then a token
every `--token-ms`) with the Batch API on. A 10,000-line JSONL file (chat requests, `--batch-tokens`
each) is uploaded once through POST /v1/files.

1. Interactive TTFT with and without the batch: `--clients` closed-loop streaming clients (each
   sends its next request when its last one ends) for `--window-s` seconds, measuring the time to the
   first content chunk. Windows alternate, `--rounds` times: one without a batch, then one while a
   batch made from the 10,000-line file runs (created before the window, cancelled after it), so slow
   drift of the shared machine's load hits both sides alike. Reported: p50 and p99 TTFT of each side
   over all its windows, the with/without p99 ratio (goal: within 10 % on the mock engine), and the
   median of the per-round p99 ratios (one window hit by a load spike moves the pooled p99 a lot).
2. Batch throughput in idle capacity: a batch from the same file with no interactive traffic, for
   `--throughput-s` seconds (0: until it completes): lines/s and completion tokens/s, next to the
   lines/s the batch got while sharing the engine in part 1.

`--engine demo-small` (or demo-large) runs the same on a demo model in the torch engine (one torch
thread), where batch lines share the engine's forward passes with interactive requests.

    .venv/bin/python -m tokenyard.bench.batch_bench [--rounds 3] [--window-s 10] [--throughput-s 20]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp

from tokenyard.bench.admission_overload import _pct
from tokenyard.bench.serve_launch import free_port, spawn_gateway

ROOT = Path(__file__).resolve().parent.parent.parent
OUT = ROOT / "bench" / "out"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def start_gateway(port: int, args: argparse.Namespace, prefix: str, key: str) -> subprocess.Popen:
    OUT.mkdir(parents=True, exist_ok=True)
    cfg = OUT / "batch_bench.yaml"
    cfg.write_text(json.dumps({
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "redis_url": args.redis_url, "redis_prefix": prefix,
        "rate_limits": {"enabled": False}, "spend": {"enabled": False},
        "batch": {"data_dir": str(OUT / "batch_bench_data"), "max_in_flight": args.max_in_flight,
                  "idle_share": args.idle_share, "start_gap_ms": args.start_gap_ms,
                  "max_loop_lag_ms": args.max_loop_lag_ms},
        "engines": {args.engine: _engine(args)}}))
    # One torch thread: the machine is shared, and the gateway's event loop needs the other core.
    env = {**os.environ, "TOKENYARD_DEV_KEY": key, "OMP_NUM_THREADS": "1"}
    return spawn_gateway(cfg, env, port, timeout_s=300)


def _engine(args: argparse.Namespace) -> dict:
    if args.engine == "mock":
        return {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "ttft_ms": args.ttft_ms,
                "token_ms": args.token_ms, "output_len": 4096}
    # A demo engine, real forward passes; its generation may stop before max_tokens at EOS.
    return {"type": "torch", "model": str(ROOT / "models" / args.engine), "kv_cache_memory": 64 << 20}


def batch_file(lines: int, tokens: int, model: str) -> bytes:
    return "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": model, "max_tokens": tokens,
                                        "messages": [{"role": "user", "content": f"Question number {i}?"}]}}) + "\n"
                   for i in range(lines)).encode()


async def upload(session: aiohttp.ClientSession, base: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="bench.jsonl", content_type="application/jsonl")
    async with session.post(base + "/v1/files", data=form) as r:
        body = await r.json()
        assert r.status == 200, body
    return body["id"]


async def create_batch(session: aiohttp.ClientSession, base: str, file_id: str) -> str:
    async with session.post(base + "/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"}) as r:
        body = await r.json()
        assert r.status == 200, body
    while body["status"] == "validating":
        await asyncio.sleep(0.05)
        body = await batch(session, base, body["id"])
    return body["id"]


async def batch(session: aiohttp.ClientSession, base: str, batch_id: str) -> dict:
    async with session.get(f"{base}/v1/batches/{batch_id}") as r:
        return await r.json()


async def cancel(session: aiohttp.ClientSession, base: str, batch_id: str) -> None:
    async with session.post(f"{base}/v1/batches/{batch_id}/cancel") as r:
        await r.read()
    while (await batch(session, base, batch_id))["status"] not in ("cancelled", "completed"):
        await asyncio.sleep(0.1)


async def interactive(session: aiohttp.ClientSession, base: str, clients: int, seconds: float,
                      tokens: int, model: str) -> tuple[list[float], int]:
    """TTFTs of closed-loop streaming clients over `seconds`; and how many requests failed (not 200)."""
    ttfts: list[float] = []
    failed = 0
    stop = time.perf_counter() + seconds
    body = {"model": model, "max_tokens": tokens, "stream": True, "messages": CHAT}

    async def client() -> None:
        nonlocal failed
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            first = None
            async with session.post(base + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    failed += 1
                    await r.read()
                    continue
                async for raw in r.content:
                    if first is None and raw.startswith(b"data: {") and _has_text(raw[6:]):
                        first = time.perf_counter() - t0
            if first is not None:       # a reply with no text (EOS first, a demo model) has no TTFT
                ttfts.append(first)

    await asyncio.gather(*(client() for _ in range(clients)))
    return ttfts, failed


def _has_text(data: bytes) -> bool:
    """A chunk carrying completion text (the first chunk may carry only the role)."""
    choices = json.loads(data).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def run(args: argparse.Namespace, base: str, key: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    connector = aiohttp.TCPConnector(limit=args.clients + 8)
    async with aiohttp.ClientSession(headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        file_id = await upload(session, base, batch_file(args.lines, args.batch_tokens, args.engine))
        await interactive(session, base, args.clients, 2.0, args.tokens, args.engine)         # warm-up
        without: list[float] = []
        with_batch: list[float] = []
        rounds = []
        for i in range(args.rounds):
            load0 = os.getloadavg()[0]
            t, f0 = await interactive(session, base, args.clients, args.window_s, args.tokens, args.engine)
            without += t
            bid = await create_batch(session, base, file_id)
            await asyncio.sleep(1.0)             # the batch's lines fill their share of the engine
            before = (await batch(session, base, bid))["request_counts"]["completed"]
            t0 = time.perf_counter()
            w, f1 = await interactive(session, base, args.clients, args.window_s, args.tokens, args.engine)
            shared_s = time.perf_counter() - t0
            after = (await batch(session, base, bid))["request_counts"]["completed"]
            with_batch += w
            await cancel(session, base, bid)
            rounds.append({"round": i, "load_1m": load0, "without_p99_ms": _pct(t, 0.99) * 1e3,
                           "with_p99_ms": _pct(w, 0.99) * 1e3, "without_n": len(t), "with_n": len(w),
                           "failed": f0 + f1, "batch_lines_per_s_shared": (after - before) / shared_s})
            print(json.dumps(rounds[-1]), flush=True)
        # Batch throughput in idle capacity: no interactive traffic at all.
        bid = await create_batch(session, base, file_id)
        t0 = time.perf_counter()
        done = 0
        while True:
            await asyncio.sleep(0.5)
            b = await batch(session, base, bid)
            done = b["request_counts"]["completed"]
            if b["status"] == "completed" or (args.throughput_s and time.perf_counter() - t0 >= args.throughput_s):
                break
        idle_s = time.perf_counter() - t0
        completed = b["status"] == "completed"
        if not completed:
            await cancel(session, base, bid)
    ms = 1e3
    shared_rates = [r["batch_lines_per_s_shared"] for r in rounds]
    return {
        "rounds": rounds,
        "figures": {
            "interactive_without_p50_ms": _pct(without, 0.5) * ms, "interactive_without_p99_ms": _pct(without, 0.99) * ms,
            "interactive_with_p50_ms": _pct(with_batch, 0.5) * ms, "interactive_with_p99_ms": _pct(with_batch, 0.99) * ms,
            "p99_ratio_with_over_without": _pct(with_batch, 0.99) / _pct(without, 0.99),
            # Per-round ratios, middle one: a load spike of the shared machine in one window moves the
            # pooled p99 more than the batch does.
            "p99_ratio_median_of_rounds": statistics.median(r["with_p99_ms"] / r["without_p99_ms"] for r in rounds),
            "p50_ratio_with_over_without": _pct(with_batch, 0.5) / _pct(without, 0.5),
            "interactive_requests_without": len(without), "interactive_requests_with": len(with_batch),
            "interactive_failed": sum(r["failed"] for r in rounds),
            "batch_lines_per_s_while_shared": sum(shared_rates) / len(shared_rates) if shared_rates else None,
            "batch_lines_per_s_idle": done / idle_s, "batch_tokens_per_s_idle": done * args.batch_tokens / idle_s,
            "batch_idle_lines_done": done, "batch_idle_seconds": idle_s, "batch_idle_completed": completed,
        }}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=10_000, help="lines in the batch file")
    ap.add_argument("--rounds", type=int, default=3, help="alternating without/with windows")
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--throughput-s", type=float, default=20.0, help="idle-capacity run length (0: to completion)")
    ap.add_argument("--clients", type=int, default=4, help="interactive closed-loop clients")
    ap.add_argument("--tokens", type=int, default=8, help="max_tokens of an interactive request")
    ap.add_argument("--batch-tokens", type=int, default=16, help="max_tokens of a batch line")
    ap.add_argument("--engine", default="mock", choices=["mock", "demo-small", "demo-large"],
                    help="the mock engine, or a demo model on the torch engine (1 thread)")
    ap.add_argument("--ttft-ms", type=float, default=50.0, help="mock engine only")
    ap.add_argument("--token-ms", type=float, default=10.0, help="mock engine only")
    ap.add_argument("--max-in-flight", type=int, default=16, help="batch.max_in_flight")
    ap.add_argument("--idle-share", type=float, default=0.5, help="batch.idle_share")
    ap.add_argument("--start-gap-ms", type=float, default=5.0, help="batch.start_gap_ms")
    ap.add_argument("--max-loop-lag-ms", type=float, default=2.0, help="batch.max_loop_lag_ms")
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    ap.add_argument("--name", default="batch_mock")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.name)
    prefix, key, port = f"bench:batch:{secrets.token_hex(4)}:", "bench-" + secrets.token_hex(12), free_port()
    proc = start_gateway(port, args, prefix, key)
    try:
        result = asyncio.run(run(args, f"http://127.0.0.1:{port}", key))
    finally:
        proc.terminate()
        proc.wait(30)
        _cleanup(args.redis_url, prefix)
    print(json.dumps(result["figures"], indent=2))
    if not args.no_results:
        settings = {k: getattr(args, k) for k in ("lines", "rounds", "window_s", "throughput_s", "clients", "tokens",
                                                   "batch_tokens", "ttft_ms", "token_ms", "max_in_flight",
                                                   "idle_share", "start_gap_ms", "max_loop_lag_ms", "engine")}
        print(rec.write(result["figures"], result["rounds"], settings=settings))


def _cleanup(redis_url: str, prefix: str) -> None:
    import redis
    client = redis.Redis.from_url(redis_url)
    names = list(client.scan_iter(match=prefix + "*", count=1000))
    for i in range(0, len(names), 1000):
        client.delete(*names[i:i + 1000])
    client.close()


if __name__ == "__main__":
    main()
