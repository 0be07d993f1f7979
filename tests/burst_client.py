"""A burst of chat requests from a process of its own (so client and gateway do not share a GIL and
the latencies measured are the gateway's). Prints one JSON list of results.

    python tests/burst_client.py URL KEY N DEADLINE_MS GAP_S
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

MSG = [{"role": "user", "content": "hi"}]


async def burst(url: str, key: str, n: int, deadline_ms: int, gap_s: float) -> list[dict]:
    async def one(session: aiohttp.ClientSession, i: int) -> dict:
        await asyncio.sleep(i * gap_s)
        t0 = time.perf_counter()
        async with session.post(url, json={"model": "mock", "messages": MSG, "max_tokens": 8},
                                headers={"Authorization": f"Bearer {key}", "x-request-id": f"burst{i}",
                                         "x-request-deadline-ms": str(deadline_ms)}) as resp:
            body = await resp.json()
            return {"id": f"burst{i}", "status": resp.status, "headers": dict(resp.headers), "body": body,
                    "latency": time.perf_counter() - t0}

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=n)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


if __name__ == "__main__":
    url, key, n, deadline_ms, gap_s = sys.argv[1:6]
    print(json.dumps(asyncio.run(burst(url, key, int(n), int(deadline_ms), float(gap_s)))))
