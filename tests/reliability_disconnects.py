"""The disconnects scenario: clients completing or leaving at random points, mock engine or
demo-small; afterwards nothing leaked and the spend ledger matches what reached the engine."""
from __future__ import annotations

import asyncio
import random
import secrets
import time

from gateway_helpers import SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, wait_ledger
from reliability_common import MODEL, ErrorLogs, Report, check_idle, check_ledger
from reliability_http import chat_raw


# --- disconnects ----------------------------------------------------------------------------------
def record_engine_requests(inner_engine) -> list[str]:
    """Wrap an engine's add_request: the client request id of every request that reached it."""
    seen: list[str] = []
    original = inner_engine.add_request

    def add_request(request_id, *args, **kwargs):
        original(request_id, *args, **kwargs)
        seen.append(request_id.rsplit("-", 1)[0])

    inner_engine.add_request = add_request
    return seen


MODES = ("complete", "complete_stream", "partial_body", "cut_early", "mid_stream", "cut_nonstream")


async def _disconnect_load(port: int, keys: list[str], n: int, model: str, concurrency: int, max_cut_s: float,
                           max_tokens: tuple[int, int], seed: int) -> dict[str, dict]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    seen: dict[str, dict] = {}

    async def one(i: int) -> None:
        mode = rng.choice(MODES)
        rid = f"dc{seed}-{i}"
        stream = mode in ("complete_stream", "mid_stream") or (mode in ("cut_early", "partial_body")
                                                                and rng.random() < 0.5)
        body = {"model": model, "messages": [{"role": "user", "content": f"disconnect {i} " * rng.randint(1, 6)}],
                "max_tokens": rng.randint(*max_tokens), "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        headers = {"Authorization": f"Bearer {keys[i % len(keys)]}", "x-request-id": rid}
        async with sem:
            try:
                r = await chat_raw(port, body, headers, mode="complete" if mode.startswith("complete") else mode,
                                   cut_s=rng.uniform(0, max_cut_s), cut_events=rng.randint(1, 12),
                                   rst=rng.random() < 0.3)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                r = {"status": None, "usage": None, "cut": True, "error": repr(e)}
        r["mode"] = mode
        seen[rid] = r

    await asyncio.gather(*(one(i) for i in range(n)))
    return seen


def run_disconnects(n: int, engine: str = "mock", concurrency: int = 32, seed: int = 1) -> Report:
    """n requests, each completing or leaving at a random point; mock engine or demo-small."""
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    report = Report(f"disconnects ({engine})")
    prefix = f"tytest:rel:dc:{secrets.token_hex(4)}:"
    client = redis.Redis.from_url(SHARED_REDIS)
    store = KeyStore(client, prefix)
    tenants = ["acme", "globex"]
    keys = [store.create(t, rpm=0, tpm=0, max_concurrent=0)[0] for t in tenants]
    if engine == "mock":
        doc = mock_deployment(ttft_ms=3, token_ms=2, output_len=40, max_sleep_ms=2)
        doc["engines"]["mock"]["prices"] = {"input": 123_457, "cached_input": 61_729, "output": 987_653}
        max_cut, max_tokens = 0.1, (8, 64)
    else:
        doc = {"server": {"access_log": False},
               "engines": {"demo-small": {"type": "torch", "model": str(MODEL), "kv_cache_memory": 16 << 20,
                                          "prices": {"input": 50_000, "cached_input": 10_000, "output": 200_000}}}}
        max_cut, max_tokens = 0.3, (4, 24)
    doc.update(redis_url=SHARED_REDIS, redis_prefix=prefix,
               admission={"max_concurrent_per_tenant": 0, "max_queue": 4096})
    t0 = time.perf_counter()
    try:
        with running_gateway(doc) as srv:
            reached = record_engine_requests(srv.engine(engine).engine)
            with ErrorLogs() as errors:
                seen = asyncio.run(_disconnect_load(srv.port, keys, n, engine, concurrency, max_cut, max_tokens,
                                                    seed))
            wall = time.perf_counter() - t0
            report.figures["error_logs"] = len(set(errors.records))
            report.check(not errors.records, f"errors logged: {sorted(set(errors.records))[:3]}")
            check_idle(srv, report, engine)
            wait_ledger(srv, timeout=60)
            check_ledger(client, prefix, tenants, reached, seen, report)
            statuses: dict[str, int] = {}
            for r in seen.values():
                statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
            bad = {s: c for s, c in statuses.items() if s not in ("200", "None")}
            report.check(not bad, f"unexpected statuses {bad}")
            report.figures.update(requests=n, seconds=round(wall, 1), reached_engine=len(reached),
                                  completed=sum(1 for r in seen.values() if r["usage"] is not None),
                                  cut=sum(1 for r in seen.values() if r["cut"]),
                                  by_mode={m: sum(1 for r in seen.values() if r["mode"] == m) for m in MODES})
            report.check(report.figures["completed"] > 0 and report.figures["cut"] > 0, "no mix of cut and complete")
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)
    return report
