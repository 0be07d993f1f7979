"""What the gateway adds in front of an upstream engine (issue 48 goal): the same requests sent
straight to an OpenAI-compatible server and through `tokenyard serve` with that server as a
`type: openai` engine, in interleaved rounds, at `--concurrency` concurrent clients.

The upstream is tokenyard/bench/openai_stub.py (canned replies, answered at once) so the difference
is the gateway's own cost: HTTP in and out, validation, the key, the token rate limit in Redis
(reserve and settle), admission, the prompt estimate, the upstream call on a keep-alive pool, the
relay and the usage record (spend ledger on). Each of the three (stub, gateway, client) is its own
process; on a small machine they share the cores, which the JSON records (load average, cores).

Measured per mode: non-streamed latency p50/p99, streamed time to first content chunk p50/p99, and
requests/s of the non-streamed rounds. Added = gateway percentile - direct percentile.

With `--litellm PATH` (the `litellm` command of a venv with `litellm[proxy]`, a benchmark peer kept
outside this project's dependencies), LiteLLM's proxy with one worker in front of the same stub is a
third mode in the same interleaved rounds: the request rate per gateway worker is compared.

    .venv/bin/python -m tokenyard.bench.upstream_overhead [--rounds 6] [--requests 640] [--concurrency 32] \
        [--litellm /work/litellm-venv/bin/litellm]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tokenyard.bench.serve_launch import ROOT, free_port, spawn_gateway, stop_processes, wait_ready

KEY = "sk-tybench-5f2c7d1e9a3b4c6d8e0f1a2b3c4d5e6f"   # one key for every mode (LiteLLM wants sk-...)
BODY = {"model": "big", "max_tokens": 5, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> float:
    t0 = time.perf_counter()
    async with session.post(url, json={**body, "stream": stream}, headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {await r.text()}")
        if not stream:
            await r.read()
            return time.perf_counter() - t0
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"content"' in line:
                first = time.perf_counter() - t0
        return first if first is not None else time.perf_counter() - t0


async def _round(url: str, body: dict[str, Any], n: int, concurrency: int, stream: bool) -> tuple[list[float], float]:
    conn = aiohttp.TCPConnector(limit=concurrency)
    out: list[float] = []
    async with aiohttp.ClientSession(connector=conn) as session:
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                out.append(await _one(session, url, body, stream))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=640, help="per round and mode")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--litellm", default=None, help="the litellm command (litellm[proxy]) to compare with")
    ap.add_argument("--workers", type=int, default=1,
                    help="gateway worker processes (server.workers) and LiteLLM's --num_workers: the rate per machine")
    ap.add_argument("--upstream-delay-ms", type=float, default=0.0,
                    help="the stub waits this long before each reply, as a real model does (0: answers at once, "
                         "so the gateway's CPU is the bottleneck and 32 clients queue behind it)")
    ap.add_argument("--results-name", default=None,
                    help="bench/results/NAME.json (default: upstream_overhead with the options that differ)")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    # One record per concurrency: 32 (the goal, and the LiteLLM comparison) and 1 (the added
    # latency of one request with nothing queued) are both kept.
    name = "upstream_overhead" if args.concurrency == 32 else f"upstream_overhead_c{args.concurrency}"
    if args.upstream_delay_ms:
        name += f"_delay{args.upstream_delay_ms:g}ms"
    if args.workers != 1:
        name += f"_workers{args.workers}"
    rec = RunRecorder(args.results_name or name)
    stub_port, gw_port = free_port(), free_port()
    stub = subprocess.Popen([sys.executable, "-m", "tokenyard.bench.openai_stub", "--port", str(stub_port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "TY_STUB_DELAY_MS": str(args.upstream_delay_ms)})
    gw = peer = None
    try:
        wait_ready(f"http://127.0.0.1:{stub_port}", 30, stub, path="/v1/models")
        redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
        doc = {"server": {"access_log": False, "workers": args.workers}, "redis_url": redis_url,
               "redis_prefix": f"tybench:up:{secrets.token_hex(4)}:",
               "rate_limits": {"requests": 10**9, "tokens": 10**12},
               "admission": {"max_concurrent_per_tenant": 0},
               "engines": {"big": {"type": "openai", "base_url": f"http://127.0.0.1:{stub_port}/v1",
                                   "upstream_model": "stub", "max_concurrency": 256,
                                   "prices": {"input": 1000, "cached_input": 500, "output": 2000}}}}
        cfg = Path(tempfile.mkdtemp(prefix="upbench-")) / "deployment.yaml"
        cfg.write_text(yaml.safe_dump(doc))
        env = {**os.environ, "TOKENYARD_DEV_KEY": KEY}
        gw = spawn_gateway(cfg, env, gw_port)
        urls = {"direct": f"http://127.0.0.1:{stub_port}/v1/chat/completions",
                "gateway": f"http://127.0.0.1:{gw_port}/v1/chat/completions"}
        bodies = {"direct": {**BODY, "model": "stub"}, "gateway": BODY}
        if args.litellm:
            peer_port = free_port()
            peer_cfg = cfg.parent / "litellm.yaml"
            peer_cfg.write_text(yaml.safe_dump({"model_list": [{"model_name": "big", "litellm_params": {
                "model": "openai/stub", "api_base": f"http://127.0.0.1:{stub_port}/v1", "api_key": "none"}}],
                "litellm_settings": {"set_verbose": False}, "general_settings": {"master_key": KEY}}))
            peer = subprocess.Popen([args.litellm, "--config", str(peer_cfg), "--port", str(peer_port),
                                     "--num_workers", str(args.workers)], cwd=cfg.parent, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**os.environ, "LITELLM_LOG": "ERROR"})
            wait_ready(f"http://127.0.0.1:{peer_port}", 120, peer, path="/health/liveliness")
            urls["litellm"] = f"http://127.0.0.1:{peer_port}/v1/chat/completions"
            bodies["litellm"] = BODY
        for mode in urls:      # warm-up: connections, the key cache, first imports
            asyncio.run(_round(urls[mode], bodies[mode], 64, args.concurrency, False))
        lat: dict[str, list[float]] = {m: [] for m in urls}
        ttft: dict[str, list[float]] = {m: [] for m in urls}
        rps: dict[str, list[float]] = {m: [] for m in urls}
        for r in range(args.rounds):
            order = list(urls)[r % len(urls):] + list(urls)[:r % len(urls)]
            for mode in order:
                got, wall = asyncio.run(_round(urls[mode], bodies[mode], args.requests, args.concurrency, False))
                lat[mode] += got
                rps[mode].append(len(got) / wall)
                got, _ = asyncio.run(_round(urls[mode], bodies[mode], args.requests // 2, args.concurrency, True))
                ttft[mode] += got
        ms = lambda v: round(v * 1000, 3)  # noqa: E731
        figures: dict[str, Any] = {"concurrency": args.concurrency, "rounds": args.rounds,
                                   "requests_per_round": args.requests, "upstream_delay_ms": args.upstream_delay_ms,
                                   "workers": args.workers}
        for mode in urls:
            figures[f"{mode}_p50_ms"] = ms(_pct(lat[mode], 0.5))
            figures[f"{mode}_p99_ms"] = ms(_pct(lat[mode], 0.99))
            figures[f"{mode}_ttft_p50_ms"] = ms(_pct(ttft[mode], 0.5))
            figures[f"{mode}_ttft_p99_ms"] = ms(_pct(ttft[mode], 0.99))
            figures[f"{mode}_rps_median"] = round(statistics.median(rps[mode]), 1)
        figures["added_p50_ms"] = round(figures["gateway_p50_ms"] - figures["direct_p50_ms"], 3)
        figures["added_p99_ms"] = round(figures["gateway_p99_ms"] - figures["direct_p99_ms"], 3)
        figures["added_ttft_p99_ms"] = round(figures["gateway_ttft_p99_ms"] - figures["direct_ttft_p99_ms"], 3)
        figures["goal"] = "added <= 1 ms p50 and <= 2 ms p99 at 32 concurrent; TTFT added <= 2 ms p99"
        figures["goal_met"] = (figures["added_p50_ms"] <= 1 and figures["added_p99_ms"] <= 2
                               and figures["added_ttft_p99_ms"] <= 2)
        if "litellm" in urls:
            figures["rps_vs_litellm"] = round(figures["gateway_rps_median"] / figures["litellm_rps_median"], 2)
            if args.workers == 1:
                figures["litellm_goal"] = "gateway requests/s per worker >= 10x LiteLLM's proxy (issue 48)"
                figures["litellm_goal_met"] = figures["rps_vs_litellm"] >= 10
            else:
                figures["litellm_goal"] = (f"requests/s per machine, {args.workers} workers each, "
                                           ">= 20x LiteLLM's proxy (issue 49)")
                figures["litellm_goal_met"] = figures["rps_vs_litellm"] >= 20
        print(figures)
        rec.write(figures, [{"rps": rps}], driver="aiohttp clients, stub upstream, tokenyard serve (spend on)")
    finally:
        stop_processes(gw, peer, stub)


if __name__ == "__main__":
    main()
