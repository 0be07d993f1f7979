"""Sleeping replicas in the pool (tokenyard/gateway/backends/replica_pool.py, replica_sleep.py) and the admin
API (tokenyard/gateway/routes/replica_api.py), with mock engines: a sleeping replica is not chosen while
another is awake and not counted as capacity; a request to an all-asleep engine wakes one and
completes; a replica that fails while waking is down and its request runs elsewhere, or ends with a
clear error, never hangs; bad calls are OpenAI-shaped 4xx naming the field."""
from __future__ import annotations

import asyncio
import json
import re

import pytest
from gateway_helpers import ROOT, mock_deployment, running_gateway
from replica_helpers import pool_deployment, start_replicas

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.sleep_level import SleepLevelError
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.mock_engine import MockEngine
from tokenyard.gateway.backends.replica_metrics import ReplicaCollector
from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
from tokenyard.gateway.backends.replica_sleep import ReplicaControlError, sleep_replica, wake_replica
from tokenyard.gateway.config.replica_config import PoolConfig

DEMO = ROOT / "models" / "demo-small"
PARAMS = SamplingParams(max_tokens=4)
TIMEOUT_S = 10.0     # every request must end well within this (a hang fails the test)


class BrokenWake(MockEngine):
    """A mock whose wake crashes, as a replica whose reload fails."""

    def wake(self):
        if self.sleep_level:
            raise RuntimeError("reload failed")
        return {}


def _pool(*cores, **cfg) -> ReplicaPool:
    c = PoolConfig(**cfg)
    return ReplicaPool("mock", [Replica(f"r{i}", AsyncEngine(e, f"r{i}"), c, remote=False)
                                for i, e in enumerate(cores)], c)


async def _run(pool: ReplicaPool, rid: str):
    stream = pool.add_request(rid, [5, 6, 7], PARAMS)
    outs = []
    while True:
        out = await asyncio.wait_for(stream.get(), TIMEOUT_S)
        outs.append(out)
        if out.finished:
            return stream, outs


def _states(pool: ReplicaPool) -> dict[str, float]:
    fams = {f.name: f for f in ReplicaCollector(lambda: {"mock": type("H", (), {"engine": pool})()}).collect()}
    return {s.labels["state"]: s.value for s in fams["tokenyard_engine_replicas"].samples}


def test_a_sleeping_replica_is_skipped_and_not_counted_while_another_is_awake():
    async def main():
        pool = _pool(MockEngine(DEMO, max_num_seqs=8), MockEngine(DEMO, max_num_seqs=8))
        await pool.start()
        try:
            a, b = pool.replicas
            assert pool.stats().max_num_seqs == 16
            result = await sleep_replica(a, 1, 5.0)
            assert result["sleep_level"] == 1 and result["sleep_state"] == "asleep" and a.state == "asleep"
            assert pool.stats().max_num_seqs == 8                   # only the awake one is capacity
            assert _states(pool) == {"up": 1, "asleep": 1, "waking": 0, "down": 0}
            for i in range(6):
                stream, outs = await _run(pool, f"q{i}")
                assert stream.replica is b and outs[-1].finish_reason in ("stop", "length")
            assert a.sleep_state == "asleep" and a.chosen == 0
            woke = await wake_replica(a)
            assert woke["sleep_state"] == "awake" and a.state == "up" and pool.stats().max_num_seqs == 16
        finally:
            await pool.stop()
    asyncio.run(main())


def test_the_desired_replicas_signal_counts_only_awake_replicas():
    from tokenyard.gateway.admission.engine_queues import EngineQueue
    from tokenyard.gateway.config.deployment import AdmissionConfig

    async def main():
        pool = _pool(MockEngine(DEMO, max_num_seqs=8), MockEngine(DEMO, max_num_seqs=8))
        await pool.start()
        try:
            q = EngineQueue("mock", pool, AdmissionConfig(), metrics=None)
            assert q.replicas_up() == 2 and q.slots == 16
            await sleep_replica(pool.replicas[0], 2, 5.0)
            signals = q.scaling_signals()
            assert q.replicas_up() == 1 and signals.replicas == 1 and signals.slots == 8
            await sleep_replica(pool.replicas[1], 1, 5.0)
            assert q.replicas_up() == 0                              # asleep is no capacity
            assert q.slots == 16                                     # but admission still feeds the pool: a request wakes one
        finally:
            await pool.stop()
    asyncio.run(main())


def test_a_request_to_an_all_asleep_engine_wakes_the_lightest_sleeper_and_completes():
    async def main():
        pool = _pool(MockEngine(DEMO, wake_ms=200), MockEngine(DEMO, wake_ms=200))
        await pool.start()
        try:
            a, b = pool.replicas
            await sleep_replica(a, 2, 5.0)
            await sleep_replica(b, 1, 5.0)
            first = pool.add_request("w0", [5, 6, 7], PARAMS)
            assert first.replica is b and b.state == "waking"      # level 1 wakes faster
            second = pool.add_request("w1", [5, 6, 7], PARAMS)
            assert second.replica is b                              # joins the wake under way, a stays asleep
            assert _states(pool)["waking"] == 1
            for s in (first, second):
                while not (out := await asyncio.wait_for(s.get(), TIMEOUT_S)).finished:
                    pass
                assert out.finish_reason in ("stop", "length")
            assert b.state == "up" and a.state == "asleep" and b.engine.last_wake_s >= 0.2 * 0.9
        finally:
            await pool.stop()
    asyncio.run(main())


def test_a_replica_that_fails_while_waking_is_down_and_the_request_runs_elsewhere():
    async def main():
        pool = _pool(BrokenWake(DEMO), MockEngine(DEMO))
        await pool.start()
        try:
            broken, good = pool.replicas
            await sleep_replica(broken, 1, 5.0)
            await sleep_replica(good, 2, 5.0)
            stream, outs = await _run(pool, "x")                     # the lighter sleeper (broken) is tried first
            assert stream.tried == [broken, good] and stream.replica is good
            assert outs[-1].finish_reason in ("stop", "length") and outs[-1].error is None
            assert broken.state == "down" and pool.retries == 1
            assert _states(pool) == {"up": 1, "asleep": 0, "waking": 0, "down": 1}
        finally:
            await pool.stop()
    asyncio.run(main())


def test_a_lone_replica_that_fails_while_waking_ends_the_request_with_an_error():
    async def main():
        pool = _pool(BrokenWake(DEMO))
        await pool.start()
        try:
            r = pool.replicas[0]
            await sleep_replica(r, 1, 5.0)
            _, outs = await _run(pool, "x")                          # wait_for: never hangs
            assert outs[-1].finish_reason == "error" and "waking" in outs[-1].error
            assert r.state == "down" and pool.dead is not None
            with pytest.raises(ReplicaControlError) as e:
                await sleep_replica(r, 1, 1.0)
            assert e.value.status == 503 and e.value.code == "replica_down"
        finally:
            await pool.stop()
    asyncio.run(main())


def test_sleep_waits_for_requests_in_flight_and_refuses_when_they_outlast_the_timeout():
    async def main():
        pool = _pool(MockEngine(DEMO, token_ms=100, output_len=5))
        await pool.start()
        try:
            r = pool.replicas[0]
            stream = pool.add_request("long", [5, 6, 7], SamplingParams(max_tokens=5))
            with pytest.raises(ReplicaControlError) as e:
                await sleep_replica(r, 1, 0.05)
            assert e.value.status == 409 and e.value.code == "replica_busy" and r.state == "up"
            await sleep_replica(r, 1, 5.0)                           # waits for it, then sleeps
            outs = []
            while not stream.finished:
                outs.append(await asyncio.wait_for(stream.get(), TIMEOUT_S))
            assert sum(len(o.new_token_ids) for o in outs) == 5 and r.state == "asleep"
            with pytest.raises(ReplicaControlError) as e:
                await sleep_replica(r, 3, 1.0)
            assert e.value.status == 400 and e.value.code == "invalid_sleep_level" and e.value.param == "level"
        finally:
            await pool.stop()
    asyncio.run(main())


def test_an_engine_that_cannot_sleep_is_a_409_and_stays_as_it_was():
    class NoSleep:                     # an engine process or an upstream: no sleep()/wake()
        dead = None

    async def main():
        r = Replica("local", NoSleep(), PoolConfig(), remote=False)
        for call in (sleep_replica(r, 1, 1.0), wake_replica(r)):
            with pytest.raises(ReplicaControlError) as e:
                await call
            assert e.value.status == 409 and e.value.code == "sleep_not_supported"
        assert r.sleep_pending is False and r.state == "up"
    asyncio.run(main())


def _err(status_body):
    status, _, body = status_body
    return status, json.loads(body)["error"]


def test_admin_api_sleeps_and_wakes_an_in_process_engine_and_names_bad_input():
    with running_gateway(mock_deployment(output_len=3)) as srv:
        base = "/admin/engines/mock/replicas"
        status, _, body = srv.request("GET", base)
        listing = json.loads(body)
        assert status == 200 and listing["replicas"][0]["replica"] == "local"
        assert listing["replicas"][0]["state"] == "up" and listing["replicas"][0]["can_sleep"] is True
        status, err = _err(srv.request("POST", "/admin/engines/nope/replicas/0/sleep", {"level": 1}))
        assert status == 404 and err["code"] == "engine_not_found" and err["param"] == "engine"
        status, err = _err(srv.request("POST", f"{base}/7/sleep", {"level": 1}))
        assert status == 404 and err["code"] == "replica_not_found" and "'7'" in err["message"]
        for bad in ({"level": 3}, {"level": "1"}, {"level": 0}, {"level": None}):
            status, err = _err(srv.request("POST", f"{base}/0/sleep", bad))
            assert status == 400 and err["code"] == "invalid_sleep_level" and err["param"] == "level", bad
            assert err["type"] == "invalid_request_error"
        status, err = _err(srv.request("POST", f"{base}/0/sleep", {"level": 1, "drain_timeout_s": -1}))
        assert status == 400 and err["param"] == "drain_timeout_s"
        status, err = _err(srv.request("POST", f"{base}/0/sleep", "{not json"))
        assert status == 400 and err["code"] == "invalid_json"
        assert srv.engine().sleep_level == 0                      # nothing changed by the bad calls
        status, _, body = srv.request("POST", f"{base}/local/sleep", {"level": 2})
        assert status == 200 and json.loads(body)["sleep_level"] == 2
        metrics = srv.request("GET", "/metrics", headers={"Authorization": ""})[2].decode()
        assert re.search(r'tokenyard_engine_replicas{engine="mock",state="asleep"} 1\.0', metrics)
        status, _, chat = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and chat["usage"]["completion_tokens"] >= 3   # it woke for the request
        assert srv.engine().sleep_level == 0
        srv.request("POST", f"{base}/0/sleep", {})                 # level 1 by default
        assert srv.engine().sleep_level == 1
        status, _, body = srv.request("POST", f"{base}/0/wake")
        assert status == 200 and json.loads(body)["sleep_state"] == "awake" and srv.engine().sleep_level == 0


def test_remote_replicas_sleep_through_the_gateway_and_a_crash_while_waking_is_retried(tmp_path):
    reps = start_replicas(tmp_path, 2, output_len=3, wake_ms=1500)
    try:
        doc = pool_deployment([r.url for r in reps], policy="round_robin", health_interval_s=0.2)
        with running_gateway(doc) as srv:
            pool = srv.engine()
            base = "/admin/engines/mock/replicas"
            for i, level in ((0, 1), (1, 2)):
                status, _, body = srv.request("POST", f"{base}/{i}/sleep", {"level": level})
                assert status == 200 and json.loads(body)["sleep_level"] == level
            assert reps[0].stats()["sleep_state"] == "asleep" and reps[1].stats()["sleep_level"] == 2
            status, err = _err(srv.request("POST", f"{base}/1/sleep", {"level": 5}))
            assert status == 400 and err["param"] == "level" and err["code"] == "invalid_sleep_level"
            # replica 0 (level 1) is woken for the request; it dies while waking: the request runs on replica 1
            import threading
            killer = threading.Timer(0.6, reps[0].kill)
            killer.start()
            status, _, chat = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}]})
            killer.join()
            assert status == 200 and chat["usage"]["completion_tokens"] >= 3
            assert pool.retries == 1 and reps[1].stats()["sleep_state"] == "awake"
            status, err = _err(srv.request("POST", f"{base}/0/wake"))
            assert status == 503 and err["code"] == "replica_down"
    finally:
        for r in reps:
            r.stop()


def test_cli_sleeps_and_wakes_through_the_gateway_and_a_replica(tmp_path, capsys):
    from gateway_helpers import KEY

    from tokenyard.cli.main import main
    with running_gateway(mock_deployment()) as srv:
        gw = ["--gateway", srv.base_url, "--engine", "mock", "--replica", "0", "--key", KEY]
        assert main(["engine", "sleep", *gw, "--level", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["sleep_level"] == 2 and srv.engine().sleep_level == 2
        assert main(["engine", "wake", *gw]) == 0 and srv.engine().sleep_level == 0
        assert main(["engine", "sleep", "--gateway", srv.base_url, "--engine", "nope", "--replica", "0",
                     "--key", KEY]) == 1
        assert "engine_not_found" in capsys.readouterr().err
        assert main(["engine", "sleep", "--gateway", srv.base_url, "--key", KEY]) == 2     # no engine/replica
    rep = start_replicas(tmp_path, 1)[0]
    try:
        assert main(["engine", "sleep", "--url", rep.url, "--level", "1"]) == 0
        assert rep.stats()["sleep_level"] == 1
        assert main(["engine", "wake", "--url", rep.url]) == 0 and rep.stats()["sleep_state"] == "awake"
    finally:
        rep.stop()


def test_an_engine_process_sleeps_wakes_for_a_request_and_by_call():
    from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe

    async def main():
        ep = EngineProcess(EngineRecipe("mock", DEMO, {"wake_ms": 100, "output_len": 3}), "m")
        await ep.start()
        try:
            with pytest.raises(SleepLevelError):
                await ep.sleep(3)
            assert await ep.sleep(2) == 0.0 and ep.sleep_level == 2 and ep.sleep_state == "asleep"
            stream = ep.add_request("r", [5, 6, 7], PARAMS)
            assert ep.sleep_state == "waking"
            outs = [await asyncio.wait_for(stream.get(), TIMEOUT_S)]
            while not outs[-1].finished:
                outs.append(await asyncio.wait_for(stream.get(), TIMEOUT_S))
            assert outs[-1].finish_reason in ("stop", "length") and ep.sleep_state == "awake"
            assert ep.last_wake_s >= 0.1 * 0.9
            await ep.sleep(1)
            assert ep.sleep_level == 1
            assert "other" in await ep.wake() and ep.sleep_level == 0
            assert await ep.wake() == {}
        finally:
            await ep.stop()
    asyncio.run(main())


def test_an_engine_process_killed_while_waking_sends_its_requests_to_the_fresh_process():
    import os
    import signal

    from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe

    async def main():
        ep = EngineProcess(EngineRecipe("mock", DEMO, {"wake_ms": 3000}), "m", restart_backoff_s=0.05)
        await ep.start()
        try:
            await ep.sleep(1)
            stream = ep.add_request("r", [5, 6, 7], PARAMS)
            await asyncio.sleep(0.3)
            os.kill(ep.pid, signal.SIGKILL)                           # dies in the middle of its wake
            # it had no token: the fresh process (awake: it never slept) serves it whole
            outs = [await asyncio.wait_for(stream.get(), TIMEOUT_S)]
            while not outs[-1].finished:
                outs.append(await asyncio.wait_for(stream.get(), TIMEOUT_S))
            assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 4
            assert ep.num_restarts == 1 and ep.num_resubmitted == 1 and ep.sleep_state == "awake"
        finally:
            await ep.stop()
    asyncio.run(main())
