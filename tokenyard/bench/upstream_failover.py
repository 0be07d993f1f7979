"""Three deployments of one upstream engine under load, one killed (issue 48 goal): 0 client-visible
errors for requests that had not started streaming, no request answered twice, and spend equal to the
upstreams' reported usage to the micro-unit.

Three OpenAI-compatible stubs (tokenyard/bench/openai_stub.py, each reply after `--delay-ms`) are the
base_urls of one `type: openai` engine of `tokenyard serve` (spend ledger on, Redis under a unique
prefix). `--concurrency` clients send chat requests for `--seconds` (one in `--stream-every`
streamed); after a third of the run one stub is SIGKILLed with requests in flight on it. Then:
- every non-streamed request and every stream that had not produced a chunk must have succeeded;
- the ledger must hold exactly one record per request the client saw answered (x-request-id), none
  for a request it did not;
- the ledger's cost must equal the usage the client received (the upstream's own figures, relayed),
  priced at the engine's prices, to the micro-unit.

    .venv/bin/python -m tokenyard.bench.upstream_failover [--seconds 9] [--concurrency 32] [--delay-ms 20]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tokenyard.bench.serve_launch import ROOT, free_port, spawn_gateway, stop_processes, wait_ready

KEY = "bench-key"
PRICES = {"input": 1_000_000, "cached_input": 500_000, "output": 3_000_000}


async def _client(url: str, seconds: float, concurrency: int, stream_every: int, kill: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"ok": 0, "errors_before_stream": [], "errors_mid_stream": 0, "usage": {}, "sent": 0}
    body = {"model": "big", "max_tokens": 5, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
    stop_at = time.monotonic() + seconds
    n = 0

    async def one(session: aiohttp.ClientSession, stream: bool) -> None:
        req = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        async with session.post(url, json=req, headers={"Authorization": f"Bearer {KEY}"}) as r:
            rid = r.headers.get("x-request-id", "")
            if r.status != 200:
                out["errors_before_stream"].append(f"{r.status} {(await r.text())[:200]}")
                return
            if not stream:
                doc = await r.json()
                out["usage"][rid] = doc["usage"]
                out["ok"] += 1
                return
            got_chunk, usage, failed = False, None, False
            async for line in r.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    failed = True
                    break
                got_chunk = got_chunk or bool(doc.get("choices"))
                usage = doc.get("usage") or usage
            if failed:
                if got_chunk:
                    out["errors_mid_stream"] += 1
                else:
                    out["errors_before_stream"].append("stream error before its first chunk")
                return
            out["usage"][rid] = usage
            out["ok"] += 1

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal n
        while time.monotonic() < stop_at:
            n += 1
            out["sent"] += 1
            await one(session, n % stream_every == 0)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        killer = asyncio.get_running_loop().call_later(seconds / 3, kill)
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        killer.cancel()
    return out


def _ledger(redis_url: str, prefix: str, tenant: str) -> list[dict[str, Any]]:
    import redis

    from tokenyard.gateway.spend.redis_keys import stream_key
    from tokenyard.gateway.spend.store import stream_record
    client = redis.Redis.from_url(redis_url)
    try:
        return [stream_record(f) for _, f in client.xrange(stream_key(prefix, tenant))]
    finally:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=9.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--stream-every", type=int, default=4)
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    from tokenyard.policies.schema import Prices
    rec = RunRecorder("upstream_failover")
    ports = [free_port() for _ in range(3)]
    env = {**os.environ, "TY_STUB_DELAY_MS": str(args.delay_ms)}
    stubs = [subprocess.Popen([sys.executable, "-m", "tokenyard.bench.openai_stub", "--port", str(p)], cwd=ROOT,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
    gw = None
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    prefix = f"tybench:fo:{secrets.token_hex(4)}:"
    try:
        for p, s in zip(ports, stubs):
            wait_ready(f"http://127.0.0.1:{p}", 30, s, path="/v1/models")
        doc = {"server": {"access_log": False}, "redis_url": redis_url, "redis_prefix": prefix,
               "rate_limits": {"requests": 10**9, "tokens": 10**12}, "admission": {"max_concurrent_per_tenant": 0},
               "engines": {"big": {"type": "openai", "base_urls": [f"http://127.0.0.1:{p}/v1" for p in ports],
                                   "upstream_model": "stub", "prices": PRICES, "cooldown_s": 1.0,
                                   "health_interval_s": 1.0, "max_attempts": 3}}}
        cfg = Path(tempfile.mkdtemp(prefix="fobench-")) / "deployment.yaml"
        cfg.write_text(yaml.safe_dump(doc))
        gw_port = free_port()
        gw = spawn_gateway(cfg, {**os.environ, "TOKENYARD_DEV_KEY": KEY}, gw_port)
        killed_at: list[float] = []

        def kill() -> None:
            stubs[1].send_signal(signal.SIGKILL)
            killed_at.append(time.time())
        t0 = time.time()
        out = asyncio.run(_client(f"http://127.0.0.1:{gw_port}/v1/chat/completions", args.seconds,
                                  args.concurrency, args.stream_every, kill))
        time.sleep(3.0)        # the ledger's writer flushes every few hundred ms
        records = [r for r in _ledger(redis_url, prefix, "dev") if r.get("engine") == "big"]
        by_id: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            by_id.setdefault(r["client_request_id"], []).append(r)
        answered = set(out["usage"])
        prices = Prices(**PRICES)
        expected = sum(prices.cost(u["prompt_tokens"], 0, u["completion_tokens"]) for u in out["usage"].values())
        ok_records = [r for r in records if r["status"] == "ok"]
        figures = {"seconds": args.seconds, "concurrency": args.concurrency, "delay_ms": args.delay_ms,
                   "requests_sent": out["sent"], "answered": out["ok"],
                   "errors_before_streaming": len(out["errors_before_stream"]),
                   "errors_mid_stream": out["errors_mid_stream"],
                   "records": len(records), "records_ok": len(ok_records),
                   "requests_recorded_twice": sum(1 for v in by_id.values() if len(v) > 1),
                   "answered_without_record": len(answered - set(by_id)),
                   "ok_records_not_answered": len({r["client_request_id"] for r in ok_records} - answered),
                   "retried_requests": sum(1 for r in records if r.get("upstream_attempts", 0) > 1),
                   "ledger_cost_micros": sum(r["cost_micros"] for r in ok_records),
                   "usage_cost_micros": expected, "killed_after_s": round(killed_at[0] - t0, 2) if killed_at else None}
        figures["goal_met"] = (figures["errors_before_streaming"] == 0 and figures["requests_recorded_twice"] == 0
                               and figures["answered_without_record"] == 0
                               and figures["ok_records_not_answered"] == 0
                               and figures["ledger_cost_micros"] == figures["usage_cost_micros"])
        print(figures)
        if out["errors_before_stream"]:
            print("first errors:", out["errors_before_stream"][:5])
        rec.write(figures, [{"errors": out["errors_before_stream"][:20]}],
                  driver="aiohttp clients, three stub upstreams (one SIGKILLed), tokenyard serve, spend on")
    finally:
        stop_processes(gw, *stubs)


if __name__ == "__main__":
    main()
