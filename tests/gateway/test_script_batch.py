"""ScriptBatch (tokenyard/gateway/store/script_batch.py) against the shared Redis: calls made while
one is on its way share one pipeline and each gets its own script's answer, in order; a lone call
goes at once; NOSCRIPT reruns only the calls it hit; a pipeline that fails fails every call in it;
a caller cancelled while waiting is left out."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from gateway_helpers import SHARED_REDIS
from redis.asyncio.client import Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError

from tokenyard.gateway.store.script_batch import ScriptBatch

# INCRBY that returns the value after: the order of execution is visible in the answers.
INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


@pytest.fixture
def pipeline_sizes(monkeypatch) -> list[int]:
    """The number of commands in each pipeline executed during the test, in order."""
    sizes: list[int] = []
    real_execute = Pipeline.execute

    async def counting_execute(self, raise_on_error=True):
        sizes.append(len(self.command_stack))
        return await real_execute(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", counting_execute)
    return sizes


def test_calls_made_while_one_is_on_its_way_share_the_next_round_trip(prefix, pipeline_sizes):
    sizes = pipeline_sizes
    async def run() -> tuple[list[int], int]:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        batch = ScriptBatch(client, client.register_script(INCR))
        key = prefix + "n"
        answers = await asyncio.gather(*(batch([key], [1]) for _ in range(20)))
        alone = await batch([key], [100])      # nothing on its way: no pipeline
        await client.aclose()
        return list(answers) + [alone], batch.batches

    answers, batches = asyncio.run(run())
    # The first went alone; the 19 behind it in one pipeline, in order.
    assert answers == list(range(1, 21)) + [120]
    assert batches == 1 and sizes == [19]


def test_a_server_without_the_script_runs_the_batch_once_it_is_loaded(prefix, pipeline_sizes):
    sizes = pipeline_sizes
    async def run() -> list[int]:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        # A comment only this run has: the server lacks the script, so the batch meets NOSCRIPT.
        batch = ScriptBatch(client, client.register_script(INCR + f" -- {prefix}"))
        batch._busy = True                      # as if a call were on its way: these five wait
        waiting = [asyncio.ensure_future(batch([prefix + "n"], [1])) for _ in range(5)]
        await asyncio.sleep(0)
        batch._busy = False
        batch._send_waiting()                   # what the call on its way does when it is back
        out = await asyncio.gather(*waiting)
        await client.aclose()
        return list(out)

    assert asyncio.run(run()) == [1, 2, 3, 4, 5]
    assert sizes == [5, 5]                      # NOSCRIPT for all five, then each ran once


def test_a_failed_pipeline_fails_its_calls_and_a_cancelled_waiter_is_left_out(prefix, monkeypatch):
    async def broken_execute(self, raise_on_error=True):
        raise RedisConnectionError("gone")

    async def run() -> tuple[list, str | None]:
        client = aioredis.Redis.from_url(SHARED_REDIS)
        script = client.register_script(INCR)
        await client.script_load(INCR)
        batch = ScriptBatch(client, script)
        key = prefix + "n"
        first = asyncio.ensure_future(batch([key], [1]))
        await asyncio.sleep(0)                  # on its way now
        cancelled = asyncio.ensure_future(batch([key], [1000]))
        failing = [asyncio.ensure_future(batch([key], [1])) for _ in range(3)]
        await asyncio.sleep(0)
        cancelled.cancel()
        monkeypatch.setattr(Pipeline, "execute", broken_execute)
        out = await asyncio.gather(first, *failing, return_exceptions=True)
        monkeypatch.undo()
        value = await client.get(key)
        await client.aclose()
        return out, value.decode() if value else None

    out, value = asyncio.run(run())
    assert out[0] == 1                                        # the lone call went before the break
    assert all(isinstance(e, RedisConnectionError) for e in out[1:])
    assert value == "1"                                       # the cancelled waiter's 1000 never ran
