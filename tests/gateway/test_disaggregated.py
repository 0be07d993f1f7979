"""Disaggregated serving (gateway/backends/disaggregated.py, engines/serving/kv_handover.py) with real
replica processes of the tiny demo model (`tokenyard engine serve`, role prefill / decode):
greedy tokens after a hand-over equal those of one engine (fp32 and int8 KV, shared memory and
TCP), the decode replica computes only the prompt's tail, a prefill replica killed mid-request is
retried on another, a decode replica killed before the first token is too, and the deployment
keys are checked."""
from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import pytest
from engine_helpers import random_prompts
from replica_helpers import ROOT, ReplicaProcess

from tokenyard.engines import LLM, SamplingParams
from tokenyard.gateway.backends.disaggregated import DisaggregatedPool, build_disaggregated
from tokenyard.gateway.config.deployment import DeploymentError, load_deployment
from tokenyard.gateway.config.replica_config import parse_replica_keys

DEMO_SMALL = ROOT / "tokenyard" / "models" / "demo-small"
BS = 16
# seed set: a colocated run's prefill then splits at the cacheable boundary as the hand-over's does
# (scheduler._chunk_len), so the two compute the same chunks and any difference is the KV's.
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, seed=0)
PROMPTS = random_prompts(4, 90, 260, 1962, seed=11)


def _engine(kv: str, role: str) -> dict:
    return {"type": "torch", "model": str(DEMO_SMALL), "kv_cache_memory": 8 << 20, "kv_cache_dtype": kv,
            "role": role}


def _start(tmp_path, kv: str, roles: list[str]) -> list[ReplicaProcess]:
    procs = [ReplicaProcess(tmp_path, _engine(kv, role), name="tiny") for role in roles]
    try:
        for p in procs:
            p.wait_ready(60)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def _pool(procs: list[ReplicaProcess], roles: list[str], **disagg) -> DisaggregatedPool:
    raw = {"replicas": [{"url": p.url, "role": r} for p, r in zip(procs, roles)],
           "replica_pool": {"policy": "round_robin", "health_interval_s": 0.2, "max_attempts": 2},
           "disaggregation": {"min_prompt_tokens": 32, **disagg}}
    pool = build_disaggregated("tiny", SimpleNamespace(replicas=parse_replica_keys(raw, "engines.tiny", ValueError)),
                      lambda spec: None)
    assert isinstance(pool, DisaggregatedPool)
    return pool


async def _collect(pool: DisaggregatedPool, rid: str, prompt: list[int]) -> tuple[list[int], str | None]:
    stream = pool.add_request(rid, prompt, GREEDY)
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(stream.get(), 60)
        tokens += out.new_token_ids
        if out.finished:
            return tokens, out.finish_reason


def _colocated(kv: str, prompts) -> list[list[int]]:
    llm = LLM(DEMO_SMALL, kv_cache_memory=8 << 20, kv_cache_dtype=kv, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


async def _started(pool: DisaggregatedPool) -> None:
    await pool.start()
    deadline = time.monotonic() + 10
    while not all(r.routable for r in pool.replicas):
        assert time.monotonic() < deadline, "replicas not admitted"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("kv,transport", [("auto", "shm"), ("int8", "tcp")])
def test_handover_gives_the_tokens_of_one_engine(tmp_path, kv, transport):
    want = _colocated(kv, PROMPTS)
    procs = _start(tmp_path, kv, ["prefill", "decode"])
    try:
        pool = _pool(procs, ["prefill", "decode"], kv_transport=transport)

        async def run():
            await _started(pool)
            try:
                got = []
                for i, p in enumerate(PROMPTS):
                    got.append(await _collect(pool, f"r{i}", p))
                    assert pool.num_in_flight == 0           # finished flows leave the pool
                return got
            finally:
                await pool.stop()

        got = asyncio.run(run())
        assert [t for t, _ in got] == want
        assert all(reason == "length" for _, reason in got)
        assert pool.handovers == len(PROMPTS) and pool.colocated == 0
        pre, dec = (p.stats() for p in procs)
        assert pre["role"] == "prefill" and dec["role"] == "decode"
        assert pre["kv_exported"] == len(PROMPTS)
        full = sum((len(p) - 1) // BS for p in PROMPTS)
        assert dec["kv_imported_blocks"] == full and dec["kv_import_failures"] == 0
        # The decode replica hit every imported block: it computed only the tails.
        assert dec["prefix_cache_hit_tokens"] == full * BS
        assert pre["kv_port"] is None and isinstance(dec["kv_port"], int)    # only a decode replica receives
    finally:
        for p in procs:
            p.stop()


@pytest.mark.slow
def test_killed_prefill_replica_mid_request_is_retried_on_another(tmp_path):
    want = _colocated("auto", PROMPTS[:1])
    # round_robin's first prefill choice in a fresh pool is the second prefill replica (turn 1: the
    # decode choice took turn 0); asserted below. The victim is stopped, so the request sits in its
    # socket, then killed mid-request (the connection is reset).
    procs = _start(tmp_path, "auto", ["prefill", "prefill", "decode"])
    victim = procs[1]
    try:
        pool = _pool(procs, ["prefill", "prefill", "decode"])

        async def run():
            await _started(pool)
            try:
                victim.proc.send_signal(signal.SIGSTOP)
                task = asyncio.ensure_future(_collect(pool, "k0", PROMPTS[0]))
                await asyncio.sleep(1.0)
                assert not task.done()
                victim.proc.send_signal(signal.SIGKILL)
                return await asyncio.wait_for(task, 60)
            finally:
                await pool.stop()

        tokens, reason = asyncio.run(run())
        assert (tokens, reason) == (want[0], "length")
        assert pool.replicas[1].chosen == 1 and pool.replicas[0].chosen == 1   # the victim, then the other
        assert pool.prefill_failures == 1 and pool.handovers == 1
        assert procs[0].stats()["kv_exported"] == 1
    finally:
        for p in procs:
            p.stop()


@pytest.mark.slow
def test_killed_decode_replica_before_first_token_is_retried_on_another(tmp_path):
    want = _colocated("auto", PROMPTS[1:2])
    procs = _start(tmp_path, "auto", ["prefill", "decode", "decode"])
    victim = procs[1]
    try:
        pool = _pool(procs, ["prefill", "decode", "decode"])

        async def run():
            await _started(pool)
            try:
                victim.proc.send_signal(signal.SIGSTOP)       # the generate request waits in its socket
                task = asyncio.ensure_future(_collect(pool, "k1", PROMPTS[1]))
                deadline = time.monotonic() + 20
                while pool.handovers == 0:                    # the prefill replica has answered
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                assert not task.done()
                victim.proc.send_signal(signal.SIGKILL)
                return await asyncio.wait_for(task, 60)
            finally:
                await pool.stop()

        tokens, reason = asyncio.run(run())
        assert (tokens, reason) == (want[0], "length")
        assert pool.replicas[1].retries_from == 1                    # round_robin chose the victim first
        assert pool.decode_retries == 1 and pool.handovers == 2     # the second hand-over: an export
        assert procs[2].stats()["kv_imported_blocks"] == (len(PROMPTS[1]) - 1) // BS
    finally:
        for p in procs:
            p.stop()


def test_hung_decode_replica_times_out_and_the_client_gets_an_error(tmp_path):
    """One decode replica that never answers: after first_token_timeout_s the request ends with an
    error (never a hang), and the replica counts a failure."""
    procs = _start(tmp_path, "auto", ["prefill", "decode"])
    try:
        pool = _pool(procs, ["prefill", "decode"], first_token_timeout_s=1.5)

        async def run():
            await _started(pool)
            try:
                procs[1].proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                tokens, reason = await asyncio.wait_for(_collect(pool, "h0", PROMPTS[0]), 30)
                return tokens, reason, time.monotonic() - t0
            finally:
                procs[1].proc.send_signal(signal.SIGCONT)
                await pool.stop()

        tokens, reason, seconds = asyncio.run(run())
        assert tokens == [] and reason == "error"
        assert 1.5 <= seconds < 15
    finally:
        for p in procs:
            p.stop()


def test_a_request_aborted_at_the_gateway_cancels_its_prefill_on_the_prefill_replica(tmp_path):
    """The prefill replica (max_num_seqs 1) is busy with long requests, so the hand-over's prefill waits
    in its engine; the gateway aborts the request: the replica sees the connection close and aborts the
    prefill (it leaves the engine while the long requests still run; nothing is exported afterwards,
    when they are gone)."""
    pre_engine = {**_engine("auto", "prefill"), "max_num_seqs": 1}
    procs = [ReplicaProcess(tmp_path, pre_engine, name="tiny"), ReplicaProcess(tmp_path, _engine("auto", "decode"),
                                                                                 name="tiny")]
    try:
        for p in procs:
            p.wait_ready(60)
        pool = _pool(procs, ["prefill", "decode"])
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

        def wait_for(check, what: str, timeout: float = 10.0) -> dict:
            deadline = time.monotonic() + timeout
            while True:
                doc = procs[0].stats()
                if check(doc):
                    return doc
                assert time.monotonic() < deadline, f"{what}: {doc}"
                time.sleep(0.02)

        async def run():
            await _started(pool)
            prefill_replica = pool.replicas[0].engine
            try:
                blockers = [prefill_replica.add_request(f"long{i}", PROMPTS[1][:20], long) for i in range(20)]
                assert (await asyncio.wait_for(blockers[0].get(), 30)).new_token_ids
                stream = pool.add_request("gone", PROMPTS[0], GREEDY)
                await asyncio.to_thread(wait_for, lambda d: d["in_flight"] == 21, "the prefill never arrived")
                pool.abort("gone")
                assert (await asyncio.wait_for(stream.get(), 5)).finish_reason == "abort"
                doc = await asyncio.to_thread(wait_for, lambda d: d["kv_prefills_cancelled"] == 1,
                                              "the prefill was not cancelled", 5)
                assert doc["kv_exported"] == 0 and doc["in_flight"] <= 20     # only long requests are left
                assert not blockers[-1].finished      # ... and they still run: the prefill never got its turn
                for i in range(20):
                    prefill_replica.abort(f"long{i}")
                await asyncio.to_thread(wait_for, lambda d: d["in_flight"] == 0 and d["num_running"] == 0,
                                        "the long requests did not end")
            finally:
                await pool.stop()

        asyncio.run(run())
        st = procs[0].stats()
        assert st["kv_exported"] == 0 and st["kv_prefills_cancelled"] == 1 and st["num_waiting"] == 0
        assert pool.handovers == 0
    finally:
        for p in procs:
            p.stop()


def test_roles_in_the_deployment(tmp_path):
    base = {"type": "torch", "model": str(DEMO_SMALL)}

    def load(engine):
        path = tmp_path / "dep.yaml"
        import yaml
        path.write_text(yaml.safe_dump({"engines": {"tiny": engine}}))
        return load_deployment(path).engines["tiny"]

    spec = load({**base, "role": "decode", "replicas": [{"url": "http://a:1", "role": "prefill"},
                                                         {"url": "http://b:1", "role": "decode"},
                                                         {"url": "http://c:1"}],
                 "disaggregation": {"kv_transport": "tcp", "min_prompt_tokens": 0}})
    assert spec.role == "decode" and [r.role for r in spec.replicas.replicas] == ["prefill", "decode", "both"]
    assert spec.replicas.disaggregated and spec.replicas.disagg.kv_transport == "tcp"
    assert load(base).role == "both"
    for bad, match in [({"role": "prefil"}, "role must be one of"),
                       ({"replicas": [{"url": "http://a:1", "role": "prefill"}]}, "needs a replica of role prefill"),
                       ({"replicas": [{"local": True, "role": "decode"}]}, "only a remote replica"),
                       ({"disaggregation": {"kv_transport": "tcp"}}, "needs engines.tiny.replicas"),
                       ({"replicas": [{"url": "http://a:1"}], "disaggregation": {"kv_transport": "nixl"}},
                        "kv_transport must be one of"),
                       ({"replicas": [{"url": "http://a:1"}], "disaggregation": {"prefill_timeout_s": 0}},
                        "prefill_timeout_s must be"),
                       ({"replicas": [{"url": "http://a:1"}], "disaggregation": {"speed": 1}}, "unknown key")]:
        with pytest.raises(DeploymentError, match=match):
            load({**base, **bad})


def test_the_gateway_serves_through_a_prefill_and_a_decode_replica(tmp_path):
    """The deployment's roles make load_engines build a DisaggregatedPool; a chat request through the
    HTTP gateway is handed over (min_prompt_tokens 0) and answered, streamed and not."""
    from gateway_helpers import running_gateway, sse_events
    procs = _start(tmp_path, "auto", ["prefill", "decode"])
    try:
        engine = {"type": "torch", "model": str(DEMO_SMALL),
                  "replicas": [{"url": procs[0].url, "role": "prefill"}, {"url": procs[1].url, "role": "decode"}],
                  "replica_pool": {"health_interval_s": 0.2}, "disaggregation": {"min_prompt_tokens": 0}}
        with running_gateway({"server": {"access_log": False}, "engines": {"tiny": engine}}) as srv:
            pool = srv.engine("tiny")
            assert isinstance(pool, DisaggregatedPool)
            deadline = time.monotonic() + 10
            while not all(r.routable for r in pool.replicas):
                assert time.monotonic() < deadline
                time.sleep(0.05)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me about the sea " * 8}],
                    "max_tokens": 6, "temperature": 0}
            status, _, data = srv.chat(body)
            assert status == 200 and 1 <= data["usage"]["completion_tokens"] <= 6, data
            assert data["choices"][0]["finish_reason"] in ("stop", "length")
            status, _, raw = srv.request("POST", "/v1/chat/completions", {**body, "stream": True})
            assert status == 200 and sse_events(raw)[-1] == "[DONE]"
            assert pool.handovers == 2 and pool.colocated == 0
    finally:
        for p in procs:
            p.stop()
