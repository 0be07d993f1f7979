"""What the Responses and Anthropic Messages translations add to a request (issue 50 goal: <= 0.3 ms
p99 over /v1/chat/completions in the same run).

`tokenyard serve` with the mock engine (no delays), one sequential client (aiohttp, keep-alive) so
nothing queues: the same one-token request as chat, as a Responses request and as an Anthropic
Messages request, in interleaved rounds (the three in rotating order). The translation costs are
what separates them: parsing into the chat request, rendering the reply in the other shape (and,
for Responses, writing the stored response: `store` defaults to true as OpenAI's, so a second set
with `store: false` shows the store apart).

    .venv/bin/python -m tokenyard.bench.api_translation [--rounds 8] [--requests 300]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tokenyard.bench.serve_launch import ROOT, free_port, spawn_gateway

KEY = "bench-key"
Q = "What is 2 + 2?"
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "mock", "max_tokens": 1, "messages": [{"role": "user", "content": Q}]}),
    "responses": ("/v1/responses", {"model": "mock", "max_output_tokens": 1, "input": Q}),
    "responses_nostore": ("/v1/responses", {"model": "mock", "max_output_tokens": 1, "input": Q, "store": False}),
    "messages": ("/v1/messages", {"model": "mock", "max_tokens": 1, "messages": [{"role": "user", "content": Q}]}),
}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _run(base: str, mode: str, n: int) -> list[float]:
    path, body = MODES[mode]
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as session:
        for _ in range(n):
            t0 = time.perf_counter()
            async with session.post(base + path, json=body) as resp:
                data = await resp.read()
            out.append(time.perf_counter() - t0)
            if resp.status != 200:
                raise RuntimeError(f"{mode}: {resp.status} {data[:300]!r}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--requests", type=int, default=300, help="per round and mode")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("api_translation")
    port = free_port()
    doc = {"server": {"access_log": False}, "redis_url": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379"),
           "redis_prefix": f"tybench:api:{secrets.token_hex(4)}:", "rate_limits": {"requests": 10**9, "tokens": 10**12},
           "engines": {"mock": {"type": "mock", "model": str(ROOT / "tokenyard" / "models" / "demo-small")}}}
    cfg = Path(tempfile.mkdtemp(prefix="apibench-")) / "deployment.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    gw = spawn_gateway(cfg, {**os.environ, "TOKENYARD_DEV_KEY": KEY}, port)
    base = f"http://127.0.0.1:{port}"
    try:
        for mode in MODES:
            asyncio.run(_run(base, mode, 50))          # warm-up
        lat: dict[str, list[float]] = {m: [] for m in MODES}
        names = list(MODES)
        for r in range(args.rounds):
            for mode in names[r % len(names):] + names[:r % len(names)]:
                lat[mode] += asyncio.run(_run(base, mode, args.requests))
        ms = lambda v: round(v * 1000, 3)  # noqa: E731
        figures: dict[str, Any] = {"rounds": args.rounds, "requests_per_round": args.requests}
        for mode in MODES:
            figures[f"{mode}_p50_ms"] = ms(_pct(lat[mode], 0.5))
            figures[f"{mode}_p99_ms"] = ms(_pct(lat[mode], 0.99))
        for mode in ("responses", "responses_nostore", "messages"):
            figures[f"{mode}_added_p50_ms"] = round(figures[f"{mode}_p50_ms"] - figures["chat_p50_ms"], 3)
            figures[f"{mode}_added_p99_ms"] = round(figures[f"{mode}_p99_ms"] - figures["chat_p99_ms"], 3)
        figures["goal"] = "translation adds <= 0.3 ms p99 over /v1/chat/completions"
        figures["goal_met"] = all(figures[f"{m}_added_p99_ms"] <= 0.3 for m in ("responses", "messages"))
        print(figures)
        rec.write(figures, [], driver="one sequential aiohttp client, mock engine, tokenyard serve")
    finally:
        gw.terminate()
        gw.wait(10)


if __name__ == "__main__":
    main()
