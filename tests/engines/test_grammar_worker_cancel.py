"""A grammar check cancelled while the worker compiles (a batch line torn down, a shutdown) must not leave
its reply in the socket for the next schema to read as its own verdict: the worker is replaced."""
from __future__ import annotations

import asyncio
from pathlib import Path

from tokenyard.engines.runtime.grammar_worker import GrammarBudget, GrammarWorker

ROOT = Path(__file__).resolve().parents[2]
# Four long repeats in patterns: seconds to compile on demo-small's vocabulary (tests/gateway/test_hostile_requests.py).
SLOW = {"type": "json_schema", "schema": {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": "^([a-z][0-9]){%d,%d}$" % (500 + i, 4000 + i)} for i in range(4)}}}
FINE = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
OTHER = {"type": "json_schema", "schema": {"type": "object", "properties": {"b": {"type": "string"}}}}


def test_a_check_cancelled_mid_compile_replaces_the_worker():
    async def run() -> None:
        worker = GrammarWorker(ROOT / "models" / "demo-small", GrammarBudget(time_s=60), name="t")
        try:
            await worker.check(FINE)                      # the child is up and has answered once
            task = asyncio.create_task(worker.check(SLOW))
            await asyncio.sleep(0.5)                      # the frame is sent; the child is compiling
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert worker.num_killed == 1                 # its reply will never be read by another check
            await worker.check(OTHER)                     # a fresh child answers for this schema
        finally:
            worker.close()
    asyncio.run(run())
