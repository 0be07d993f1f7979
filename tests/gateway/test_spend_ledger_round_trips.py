"""The ledger's batch is one round trip (EVALSHA in a pipeline, no SCRIPT EXISTS first), and a
server that lacks the script still gets every record exactly once: the NOSCRIPT ones are sent
again after the script is loaded, the others are not."""
from __future__ import annotations

import asyncio
import time

import redis
from gateway_helpers import SHARED_REDIS
from redis.asyncio.client import Pipeline

from tokenyard.gateway.config.spend_settings import SpendConfig
from tokenyard.gateway.observability.metrics import GatewayMetrics
from tokenyard.gateway.spend.ledger import LINGER_S, SpendLedger
from tokenyard.gateway.spend.redis_keys import stream_key
from tokenyard.gateway.spend.usage import UsageRecord


def _record(i: int) -> UsageRecord:
    return UsageRecord(request_id=f"rt{i}", time=time.time(), engine="mock", requested_model="mock",
                       route_reason="pinned", prompt_tokens=10 + i, cached_tokens=0, completion_tokens=1,
                       cost_micros=7 * i, status="ok", finish_reason="length", ttft_s=0.01, e2e_s=0.02,
                       stream=False, tenant="rt", key_id="k1")


def _stored(metrics: GatewayMetrics, outcome: str) -> float:
    return metrics.spend_records.labels(outcome)._value.get()


def test_a_batch_asks_no_script_exists_and_a_missing_script_is_loaded_once(tmp_path, prefix, monkeypatch):
    executes: list[int] = []
    real_execute = Pipeline.execute

    async def counting_execute(self, raise_on_error=True):
        executes.append(len(self.command_stack))
        return await real_execute(self, raise_on_error)

    async def no_script_exists(self):
        raise AssertionError("the ledger's pipeline asked SCRIPT EXISTS")

    monkeypatch.setattr(Pipeline, "execute", counting_execute)
    monkeypatch.setattr(Pipeline, "load_scripts", no_script_exists)

    async def run() -> tuple[GatewayMetrics, int]:
        metrics = GatewayMetrics(lambda: {})
        ledger = SpendLedger(SHARED_REDIS, prefix, SpendConfig(spool_dir=tmp_path), metrics)
        # The same script text under a comment no other run has loaded: the server answers NOSCRIPT.
        ledger._script = ledger.redis.register_script(ledger._script.script + f"\n-- {prefix}\n")
        await ledger._store([_record(i).to_dict() for i in range(5)], "stored")     # NOSCRIPT, loaded, again
        first = len(executes)
        await ledger._store([_record(i).to_dict() for i in range(3, 8)], "stored")  # 2 seen before, 3 new
        await ledger.redis.aclose()
        return metrics, first

    metrics, first = asyncio.run(run())
    assert first == 2 and executes[:2] == [5, 5]       # the batch, then its 5 NOSCRIPT records once loaded
    assert executes[2:] == [5]                          # loaded now: one round trip for the next batch
    assert _stored(metrics, "stored") == 8 and _stored(metrics, "duplicate") == 2
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        assert client.xlen(stream_key(prefix, "rt")) == 8          # every record once
    finally:
        client.close()


def test_records_ending_within_the_linger_share_one_round_trip(tmp_path, prefix, monkeypatch):
    """One client's trickle: records a few ms apart go to Redis together, within LINGER_S of the first."""
    executes: list[tuple[float, int]] = []
    real_execute = Pipeline.execute

    async def counting_execute(self, raise_on_error=True):
        executes.append((time.perf_counter(), len(self.command_stack)))
        return await real_execute(self, raise_on_error)

    monkeypatch.setattr(Pipeline, "execute", counting_execute)

    async def run() -> tuple[float, float]:
        ledger = SpendLedger(SHARED_REDIS, prefix, SpendConfig(spool_dir=tmp_path), GatewayMetrics(lambda: {}))
        await ledger.redis.script_load(ledger._script.script)
        await ledger.start()
        first = time.perf_counter()
        for i in range(4):
            ledger(_record(i))
            await asyncio.sleep(LINGER_S / 8)
        while ledger.pending:
            await asyncio.sleep(0.001)
        done = time.perf_counter()
        await ledger.stop()
        return first, done

    first, done = asyncio.run(run())
    assert [n for _, n in executes] == [4]
    # Written once the linger had passed, and not long after (a loaded machine may add some ms).
    assert LINGER_S <= executes[0][0] - first < LINGER_S + 0.5
    assert done >= executes[0][0]
