"""The gateway's CPU per one-token request, and its added latency at 1 and 32 clients, for two
source trees in the same run (issue 49: what a change to the request path buys).

Each tree's gateway (`tokenyard serve` started from that tree, one worker, the mock engine, rate
limits on, the spend ledger on) gets, in turn and interleaved over `--rounds`:

1. a warm-up, then `--requests` sequential one-token chat requests (1 client);
2. `--seconds` of 32 concurrent clients, every request's latency kept.

Around each phase the CPU seconds of the gateway's process tree (utime + stime from /proc, the
mock engine included: it steps in the gateway process) and of the Redis server (found with
INFO server; shared with whatever else uses it, so its figure is an upper bound) are read, and
divided by the requests served in that phase. Added latency is the gateway's percentile minus the
engine's own (the same request straight into an AsyncEngine, in this process, sequential and with
32 requests at once).

    .venv/bin/python -m tokenyard.bench.gateway_cpu --trees /work/wt-base,/work/wt-new --rounds 3

Writes bench/results/gateway_cpu.json (or --results-name): per tree the medians over rounds,
and every round's figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis

from tokenyard.bench import gateway_overhead as overhead
from tokenyard.bench.serve_launch import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent.parent
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process, seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and every live descendant (an engine core, workers)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += process_cpu_s(p)
        try:
            todo += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            pass
    return total


def redis_pid(url: str) -> int | None:
    """The Redis server's pid when it runs on this machine (INFO server), else None."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server")["process_id"])
    finally:
        client.close()
    return pid if Path(f"/proc/{pid}").exists() else None


def tree_commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def start_tree_gateway(tree: Path, port: int) -> subprocess.Popen:
    """The same deployment as gateway_overhead's mock run, served by `tree`'s code."""
    cfg = ROOT / "bench" / "out" / "gateway_cpu.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(json.dumps({"server": {"host": "127.0.0.1", "port": port, "access_log": False, "workers": 1},
                               "redis_prefix": overhead.PREFIX,
                               "rate_limits": {"enabled": True, "requests": 10**9, "tokens": 10**12},
                               "engines": {"mock": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": overhead.KEY, "PYTHONPATH": str(tree),
           "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")}
    proc = subprocess.Popen([sys.executable, "-m", "tokenyard.cli.main", "serve", "--config", str(cfg),
                             "--port", str(port)], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", 60, proc)
    except BaseException:
        proc.kill()
        raise
    return proc


async def concurrent_latencies(url: str, seconds: float, concurrency: int) -> tuple[list[float], int]:
    """Every request's latency while `concurrency` clients keep one request each in flight."""
    headers = {"Authorization": f"Bearer {overhead.KEY}"}
    lat: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            async with session.post(url, json=overhead.BODY) as resp:
                await resp.read()
            if resp.status == 200:
                lat.append(time.perf_counter() - t0)
            else:
                errors += 1

    async with aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return lat, errors


async def direct_concurrent(seconds: float, concurrency: int) -> list[float]:
    """The engine's own latency with `concurrency` requests in flight (AsyncEngine, in-process)."""
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.runtime.async_engine import AsyncEngine
    from tokenyard.engines.serving.mock_engine import MockEngine
    from tokenyard.engines.text.chat_template import apply_chat_template

    engine = MockEngine(ROOT / "models" / "demo-small")
    ae = AsyncEngine(engine, "mock")
    await ae.start()
    messages: list[dict[str, Any]] = overhead.BODY["messages"]  # type: ignore[assignment]
    prompt = apply_chat_template(engine.tokenizer, messages)
    assert isinstance(prompt, str)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    lat: list[float] = []
    stop = time.perf_counter() + seconds
    count = 0

    async def client() -> None:
        nonlocal count
        while time.perf_counter() < stop:
            count += 1
            t0 = time.perf_counter()
            async for _ in ae.add_request(f"c{count}", ids, SamplingParams(max_tokens=1, temperature=0)):
                pass
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    await ae.stop()
    return lat


def measure_tree(tree: Path, args: argparse.Namespace, rpid: int | None) -> dict[str, Any]:
    port = free_port()
    proc = start_tree_gateway(tree, port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    pct, ms = overhead._pct, 1000.0
    try:
        asyncio.run(overhead.gateway_latencies(url, 300))                  # warm-up, sequential
        asyncio.run(concurrent_latencies(url, 1.0, args.concurrency))       # and every connection
        g0, r0 = tree_cpu_s(proc.pid), process_cpu_s(rpid) if rpid else 0.0
        seq = asyncio.run(overhead.gateway_latencies(url, args.requests))
        g1, r1 = tree_cpu_s(proc.pid), process_cpu_s(rpid) if rpid else 0.0
        t0 = time.perf_counter()
        conc, errors = asyncio.run(concurrent_latencies(url, args.seconds, args.concurrency))
        wall = time.perf_counter() - t0
        g2, r2 = tree_cpu_s(proc.pid), process_cpu_s(rpid) if rpid else 0.0
    finally:
        proc.terminate()
        proc.wait(30)
    return {"tree": str(tree), "commit": tree_commit(tree),
            "p50_1_ms": pct(seq, 0.5) * ms, "p99_1_ms": pct(seq, 0.99) * ms,
            "cpu_ms_per_req_1": (g1 - g0) / len(seq) * ms, "redis_cpu_ms_per_req_1": (r1 - r0) / len(seq) * ms,
            "p50_32_ms": pct(conc, 0.5) * ms, "p99_32_ms": pct(conc, 0.99) * ms,
            "rps_32": len(conc) / wall, "errors_32": errors,
            "cpu_ms_per_req_32": (g2 - g1) / max(1, len(conc)) * ms,
            "redis_cpu_ms_per_req_32": (r2 - r1) / max(1, len(conc)) * ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="comma-separated source trees (git worktrees) to compare")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of each tree")
    ap.add_argument("--requests", type=int, default=1000, help="sequential requests per tree and round")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of the 32-client phase")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--results-name", default="gateway_cpu")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.results_name)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    rpid = redis_pid(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"))
    direct1 = asyncio.run(overhead.direct_latencies(args.requests))
    direct32 = asyncio.run(direct_concurrent(args.seconds / 2, args.concurrency))
    pct, ms = overhead._pct, 1000.0
    base = {"direct_p50_1_ms": pct(direct1, 0.5) * ms, "direct_p99_1_ms": pct(direct1, 0.99) * ms,
            "direct_p50_32_ms": pct(direct32, 0.5) * ms, "direct_p99_32_ms": pct(direct32, 0.99) * ms}
    runs = []
    for rnd in range(args.rounds):
        for tree in trees:
            run = {"round": rnd, **measure_tree(tree, args, rpid)}
            for c in ("1", "32"):
                for q in ("p50", "p99"):
                    run[f"added_{q}_{c}_ms"] = run[f"{q}_{c}_ms"] - base[f"direct_{q}_{c}_ms"]
            runs.append(run)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}), flush=True)
    overhead._cleanup_redis()
    keys = ("cpu_ms_per_req_1", "cpu_ms_per_req_32", "redis_cpu_ms_per_req_1", "redis_cpu_ms_per_req_32",
            "added_p50_1_ms", "added_p99_1_ms", "added_p50_32_ms", "added_p99_32_ms", "rps_32")
    figures: dict[str, Any] = {**base, "concurrency": args.concurrency, "requests": args.requests,
                               "redis_pid_found": rpid is not None, "trees": {}}
    for tree in trees:
        mine = [r for r in runs if r["tree"] == str(tree)]
        figures["trees"][str(tree)] = {"commit": mine[0]["commit"],
                                       **{k: statistics.median(r[k] for r in mine) for k in keys}}
    print(json.dumps(figures, indent=1))
    rec.write(figures, runs, seconds=args.seconds, rounds=args.rounds)


if __name__ == "__main__":
    main()
