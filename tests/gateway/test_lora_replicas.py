"""LoRA adapters across replicas and engine processes (issue 53.2), with mock engines: the replica choice
prefers a replica holding the request's adapter (llm-d's affinity) and falls back to the usual choice; a
run-time load reaches every replica (remote ones through tokenyard engine serve's /v1/engine/adapters) or
none; an engine stepped in a child process loads and unloads through its message; the learned router's
engine set may name ENGINE:ADAPTER."""
from __future__ import annotations

import asyncio
import json

import pytest
from gateway_helpers import ROOT, mock_deployment, running_gateway
from replica_helpers import pool_deployment, start_replicas

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.lora.adapter_config import AdapterError
from tokenyard.engines.lora.adapter_errors import AdapterConflict
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe
from tokenyard.engines.serving.mock_engine import MockEngine
from tokenyard.gateway.backends.adapter_control import AdapterControlError, adapters_of, load_adapter, unload_adapter
from tokenyard.gateway.backends.replica_pool import Replica, ReplicaPool
from tokenyard.gateway.config.replica_config import PoolConfig

MODEL = ROOT / "models" / "demo-small"


def adapter_dir(root, name: str, r: int = 8):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 16}))
    return d


class Refuses(MockEngine):
    """A replica whose base the adapter does not fit."""

    def load_adapter(self, name, path):
        raise AdapterError(f"{path}: tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has shape "
                           f"[8, 64], expected [8, 576]")


def pool(*cores, policy: str = "least_loaded") -> ReplicaPool:
    cfg = PoolConfig(policy=policy)
    return ReplicaPool("mock", [Replica(f"r{i}", AsyncEngine(e, f"r{i}"), cfg, remote=False)
                                for i, e in enumerate(cores)], cfg)


def test_the_choice_prefers_a_replica_holding_the_adapter_and_falls_back():
    async def main():
        p = pool(MockEngine(MODEL), MockEngine(MODEL, lora_modules={"sql": "x"}), MockEngine(MODEL))
        await p.start()
        try:
            for i in range(6):      # least-loaded would spread these; the adapter keeps them on r1
                r = p.choose([1, 2, 3], None, adapter="sql")
                assert r.label == "r1", i
            assert {p.choose([1, 2, 3], None).label for _ in range(6)} == {"r0", "r1", "r2"}     # the base: spread
            assert {p.choose([1, 2, 3], None, adapter="other").label for _ in range(6)} == {"r0", "r1", "r2"}
            # end to end: every request for the adapter lands on r1 and is served with it
            streams = [p.add_request(f"q{i}", [1, 2, 3], SamplingParams(max_tokens=2, lora="sql")) for i in range(4)]
            assert {s.replica.label for s in streams} == {"r1"}
            for s in streams:
                while not (await asyncio.wait_for(s.get(), 10)).finished:
                    pass
            assert p.stats().lora_names == ["sql"]
        finally:
            await p.stop()
    asyncio.run(main())


def test_a_pool_load_is_all_or_nothing_and_unload_reaches_every_replica(tmp_path):
    path = str(adapter_dir(tmp_path, "chat"))

    async def main():
        good = pool(MockEngine(MODEL), MockEngine(MODEL))
        mixed = pool(MockEngine(MODEL), Refuses(MODEL))
        await good.start()
        await mixed.start()
        try:
            info = await load_adapter(good, "chat", path)
            assert info["replicas"] == ["r0", "r1"] and info["rank"] == 8
            assert [r.engine.stats().lora_names for r in good.replicas] == [["chat"], ["chat"]]
            with pytest.raises(AdapterControlError) as e:
                await load_adapter(mixed, "chat", path)
            assert e.value.status == 400 and "replica r1" in e.value.message and "q_proj.lora_A" in e.value.message
            assert adapters_of(mixed) == []                # r0 unloaded it again
            await unload_adapter(good, "chat")
            assert adapters_of(good) == []
            with pytest.raises(AdapterControlError) as e:
                await unload_adapter(good, "chat")
            assert e.value.status == 404
        finally:
            await good.stop()
            await mixed.stop()
    asyncio.run(main())


def test_an_engine_process_loads_and_unloads_through_its_message(tmp_path):
    path = str(adapter_dir(tmp_path, "chat"))

    async def main():
        ep = EngineProcess(EngineRecipe("mock", MODEL, {"token_ms": 20, "output_len": 30}), "m")
        await ep.start()
        try:
            info = await ep.load_adapter("chat", path)
            assert info["name"] == "chat" and ep.stats().lora_names == ["chat"]     # current before any step
            with pytest.raises(AdapterError, match="r must be an integer rank"):
                await ep.load_adapter("big", str(adapter_dir(tmp_path, "big", r=500)))
            stream = ep.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=30, lora="chat"))
            await asyncio.wait_for(stream.get(), 10)
            with pytest.raises(AdapterConflict, match="in flight"):
                await ep.unload_adapter("chat")
            while not (await asyncio.wait_for(stream.get(), 10)).finished:
                pass
            await ep.unload_adapter("chat")
            assert ep.stats().lora_names == []
        finally:
            await ep.stop()
    asyncio.run(main())


def test_the_gateway_loads_on_remote_replicas_and_routes_to_them(tmp_path):
    adapter_dir(tmp_path, "chat")
    procs = start_replicas(tmp_path, 2)
    try:
        doc = pool_deployment([p.url for p in procs])
        doc["engines"]["mock"]["lora_roots"] = [str(tmp_path)]
        with running_gateway(doc) as srv:
            status, _, raw = srv.request("POST", "/admin/engines/mock/adapters", {"name": "chat", "path": "chat"})
            assert status == 200, raw
            assert sorted(json.loads(raw)["replicas"]) == sorted(p.url for p in procs)
            for p in procs:
                assert p.stats()["lora_names"] == ["chat"]
            status, _, reply = srv.chat({"model": "mock:chat", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[chat]")
            status, _, raw = srv.request("GET", "/admin/engines/mock/adapters")
            assert [r["adapters"] for r in json.loads(raw)["replicas"]] == [["chat"], ["chat"]]
            status, _, raw = srv.request("DELETE", "/admin/engines/mock/adapters/chat")
            assert status == 200, raw
            assert [p.stats()["lora_names"] for p in procs] == [[], []]
    finally:
        for p in procs:
            p.stop()


def test_a_gateway_in_engine_process_mode_loads_through_the_child(tmp_path):
    adapter_dir(tmp_path, "chat")
    doc = mock_deployment()
    doc["engines"]["mock"]["lora_roots"] = [str(tmp_path)]
    doc["server"]["engine_process"] = True
    with running_gateway(doc) as srv:
        status, _, raw = srv.request("POST", "/admin/engines/mock/adapters", {"name": "chat", "path": "chat"})
        assert status == 200, raw
        status, _, reply = srv.chat({"model": "mock:chat", "max_tokens": 8,
                                     "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and reply["choices"][0]["message"]["content"].startswith("[chat]")


class _Pick:
    """Stands in for the N-engine router's decision (the artifact's scores are not what is tested)."""

    def __init__(self, engine: str) -> None:
        self.engine = engine

    def decide(self, text, prompt_tokens, cost_cap=None):
        from tokenyard.gateway.routing.decision import RouterDecision
        return RouterDecision(self.engine, "router", 0.5, {self.engine: 0.9})


def test_the_router_engine_set_may_name_an_adapter(tmp_path):
    from tokenyard.gateway.config.router_settings import parse_router_settings
    from tokenyard.gateway.routing.engine_set_router import EngineSetRouter

    engines = {"mock": None, "big": None}
    assert parse_router_settings({"engines": ["mock", "mock:sql", "big"]}, tmp_path, engines).engines == \
        ["mock", "mock:sql", "big"]
    for bad in (["mock", "other:sql"], ["mock", "mock:a:b"], ["mock", "mock:"]):
        with pytest.raises(ValueError, match="ENGINE:ADAPTER"):
            parse_router_settings({"engines": bad}, tmp_path, engines)
    with running_gateway(mock_deployment(lora_modules={"sql": "x"})) as srv:
        pick = _Pick("mock:sql")
        pick.__class__ = type("PickRouter", (_Pick, EngineSetRouter), {})   # route_plan asks isinstance
        srv.gateway.policy.router = pick
        status, headers, reply = srv.chat({"model": "auto", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200, reply
        assert reply["choices"][0]["message"]["content"].startswith("[sql]")    # ran on mock with sql
        import time
        deadline = time.monotonic() + 5
        while not srv.gateway.usage.records and time.monotonic() < deadline:
            time.sleep(0.01)
        record = srv.gateway.usage.records[-1]
        assert record.engine == "mock" and record.lora == "sql"
