"""How far concurrent requests overshoot a small spend budget (issue 46.5), through `tokenyard serve`
with mock engines: N requests at once (all in flight together: the first token comes ttft_ms
after arrival) from one key against a per-key and then a per-tenant budget with at_limit deny.
Spent is the cost of the answered requests by the one cost rule (tokenyard/policies/cost.py) from the usage
each reply reports; the goal is spent <= budget + the worst-case cost of one request.

    .venv/bin/python -m tokenyard.bench.budget_overshoot            # writes bench/results/budget_overshoot.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
from pathlib import Path

import aiohttp

from tokenyard.bench.serve_launch import free_port, spawn_gateway
from tokenyard.policies.schema import Prices

ROOT = Path(__file__).resolve().parent.parent.parent
MSG = [{"role": "user", "content": "Add 12 and 30."}]
PRICES = Prices(input=1_000_000, cached_input=500_000, output=4_000_000)   # micro-units per 1M tokens
POLICY = """\
version: 1
description: budget overshoot bench
engines: {{small: small, large: large}}
prices:
  small: {{input: 0.1, cached_input: 0.05, output: 0.4}}
  large: {{input: 1, cached_input: 0.5, output: 4}}
router: {{without_score: large}}
tenants:
  acme:
{budget}
"""
SCENARIOS = {
    "key": ('    key_budgets:\n      "*": {per_day: "0.0001", at_limit: deny}', 100),
    "tenant": ('    budget: {per_day: "0.0002", at_limit: deny}', 200),
}


def start(port: int, scenario: str, prefix: str, redis_url: str, args: argparse.Namespace):
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    policy = out / f"budget_overshoot_{scenario}.yaml"
    policy.write_text(POLICY.format(budget=SCENARIOS[scenario][0]))
    engine = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "ttft_ms": args.ttft_ms,
              "output_len": args.output_len}
    cfg = out / "budget_overshoot.yaml"
    cfg.write_text(json.dumps({
        "server": {"host": "127.0.0.1", "port": port, "access_log": False},
        "redis_url": redis_url, "redis_prefix": prefix, "policy": str(policy),
        "rate_limits": {"requests": 1_000_000, "tokens": 1_000_000_000},
        "admission": {"max_queue": 1024, "max_concurrent_per_tenant": 0},
        "routing": {"small": "small", "large": "large"},
        "engines": {"small": engine, "large": engine}}))
    env = {**os.environ, "TOKENYARD_DEV_KEY": "bench-admin-" + secrets.token_hex(8)}
    return spawn_gateway(cfg, env, port)


async def flood(url: str, key: str, n: int, max_tokens: int) -> list[dict]:
    body = {"model": "large", "messages": MSG, "max_tokens": max_tokens}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> dict:
            async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                data = await r.json()
                return {"status": r.status, "usage": data.get("usage"),
                        "code": (data.get("error") or {}).get("code"),
                        "should_retry": r.headers.get("x-should-retry")}
        return list(await asyncio.gather(*(one() for _ in range(n))))


def run(scenario: str, args: argparse.Namespace, redis_url: str) -> dict:
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    prefix = f"bench:budget:{secrets.token_hex(4)}:"
    port = free_port()
    proc = start(port, scenario, prefix, redis_url, args)
    client = redis.Redis.from_url(redis_url)
    try:
        key = KeyStore(client, prefix).create("acme", name="flood")[0]
        results = asyncio.run(flood(f"http://127.0.0.1:{port}/v1/chat/completions", key, args.concurrent,
                                    args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(30)
        names = list(client.scan_iter(match=prefix + "*"))
        if names:
            client.delete(*names)
        client.close()
    ok = [r for r in results if r["status"] == 200]
    spent = sum(PRICES.cost(r["usage"]["prompt_tokens"], r["usage"]["prompt_tokens_details"]["cached_tokens"],
                            r["usage"]["completion_tokens"]) for r in ok)
    prompt = ok[0]["usage"]["prompt_tokens"] if ok else 0
    worst = PRICES.cost(prompt, 0, args.max_tokens)
    budget = SCENARIOS[scenario][1]
    codes: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            codes[f'{r["status"]} {r["code"]}'] = codes.get(f'{r["status"]} {r["code"]}', 0) + 1
    return {"scenario": scenario, "budget_micros": budget, "concurrent": args.concurrent, "served": len(ok),
            "refused": codes, "refused_with_x_should_retry_false":
                sum(1 for r in results if r["status"] != 200 and r["should_retry"] == "false"),
            "spent_micros": spent, "overshoot_micros": max(0, spent - budget),
            "worst_case_one_request_micros": worst, "spent_over_budget": round(spent / budget, 3),
            "overshoot_within_one_request": spent <= budget + worst}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrent", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=12)
    ap.add_argument("--ttft-ms", type=float, default=300.0)
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/budget_overshoot.json")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder("budget_overshoot")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")
    runs = [run(s, args, redis_url) for s in SCENARIOS]
    figures = {f"{r['scenario']}_{k}": r[k] for r in runs
               for k in ("budget_micros", "served", "spent_micros", "worst_case_one_request_micros",
                         "overshoot_within_one_request")}
    print(json.dumps(runs, indent=2))
    if not args.no_results:
        rec.write(figures, runs, concurrent=args.concurrent, max_tokens=args.max_tokens,
                  output_len=args.output_len, ttft_ms=args.ttft_ms)


if __name__ == "__main__":
    main()
