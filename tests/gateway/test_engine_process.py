"""An engine stepped in a child process (tokenyard/engines/serving/engine_process.py), with the mock engine:
streams, refusals as 400-shaped outputs, aborts, a killed child (requests fail at once, the process
starts again), a build that fails (its exception reaches the caller), a step that raises inside the
child, and the gateway serving through it (`server.engine_process`)."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from dataclasses import dataclass

import pytest
from engine_process_helpers import MODEL, collect, recipe
from gateway_helpers import ROOT, mock_deployment, running_gateway, sse_events

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.serving.engine_process import EngineProcess, EngineRecipe, _child_main, _Link
from tokenyard.engines.serving.mock_engine import MockEngine


def test_streams_tokens_stats_and_stop():
    async def main():
        ep = EngineProcess(recipe(token_ms=1, output_len=6), "m")
        assert ep.pid != os.getpid() and ep.max_model_len == 4096
        await ep.start()
        streams = [ep.add_request(f"r{i}", [1, 2, 3], {"max_tokens": 4 + i}) for i in range(3)]
        assert ep.num_in_flight == 3
        results = [await collect(s) for s in streams]
        for i, outs in enumerate(results):
            assert sum(len(o.new_token_ids) for o in outs) == 4 + i
            assert outs[-1].finish_reason == "length" and outs[-1].num_prompt_tokens == 3
        assert ep.num_in_flight == 0
        assert ep.stats().num_steps > 0          # the child's counters, sent with each step
        proc = ep._proc
        await ep.stop()
        assert proc.returncode == 0               # it exited when the parent hung up, not by a signal

    asyncio.run(main())


def test_refusals_arrive_as_bad_request_outputs_and_duplicates_raise():
    async def main():
        ep = EngineProcess(recipe(token_ms=1), "m")
        await ep.start()
        out, = await collect(ep.add_request("long", [1] * 5000, {"max_tokens": 2}))
        assert (out.finish_reason, out.bad_request) == ("error", True) and "max_model_len" in out.error
        out, = await collect(ep.add_request("lp", [1, 2], {"max_tokens": 2, "logprobs": 1}))
        assert out.bad_request and (out.error_param, out.error_code) == ("logprobs", "unsupported_parameter")
        out, = await collect(ep.add_request("rf", [1, 2], {"max_tokens": 2, "response_format": {"type": "json_object"}}))
        assert out.bad_request and out.error_param == "grammar"
        ep.add_request("dup", [1, 2], {"max_tokens": 200})
        with pytest.raises(RequestError, match="already in use"):
            ep.add_request("dup", [1, 2], {"max_tokens": 2})
        ep.abort("dup")
        # the child still serves after refusing
        outs = await collect(ep.add_request("ok", [1, 2], {"max_tokens": 3}))
        assert outs[-1].finish_reason == "length"
        await ep.stop()

    asyncio.run(main())


def test_abort_ends_the_stream_at_once_and_frees_the_request_in_the_child():
    async def main():
        ep = EngineProcess(recipe(token_ms=5, output_len=1000), "m")
        await ep.start()
        stream = ep.add_request("a", [1, 2, 3], {"max_tokens": 1000})
        first = await asyncio.wait_for(stream.get(), 10)
        assert first.new_token_ids and not first.finished
        ep.abort("a")
        while not (out := await asyncio.wait_for(stream.get(), 10)).finished:
            pass
        assert out.finish_reason == "abort"
        for _ in range(500):                      # the child frees it at its next step
            if ep.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert ep.stats().num_running == 0 and ep.num_in_flight == 0
        await ep.stop()

    asyncio.run(main())


def test_killed_child_fails_in_flight_requests_and_is_started_again():
    async def main():
        ep = EngineProcess(recipe(token_ms=5, output_len=1000), "m", restart_backoff_s=0.01)
        await ep.start()
        stream = ep.add_request("a", [1, 2, 3], {"max_tokens": 1000})
        await asyncio.wait_for(stream.get(), 10)
        old_pid = ep.pid
        os.kill(old_pid, signal.SIGKILL)
        outs = await collect(stream)
        assert outs[-1].finish_reason == "error" and "exited" in outs[-1].error
        for _ in range(2000):
            if ep.num_restarts == 1 and ep.dead is None and ep._writer is not None:
                break
            await asyncio.sleep(0.01)
        assert ep.num_restarts == 1 and ep.dead is None and ep.pid != old_pid
        outs = await collect(ep.add_request("b", [1, 2], {"max_tokens": 3}))
        assert outs[-1].finish_reason == "length"
        await ep.stop()

    asyncio.run(main())


def test_a_build_that_fails_raises_its_own_error():
    with pytest.raises(ValueError, match="unknown mock engine option"):
        EngineProcess(recipe(no_such_option=1), "m")


@dataclass(frozen=True)
class _FailingStepRecipe:
    """Builds a mock engine whose second step raises (pickled by reference: runs in this process)."""

    def build(self) -> MockEngine:
        eng = MockEngine(MODEL, token_ms=1, output_len=50)
        step, calls = eng.step, []

        def failing_step():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom")
            return step()
        eng.step = failing_step
        return eng


@pytest.mark.timeout(60)
def test_a_step_that_raises_is_reported_and_the_child_ends():
    """The child's loop, run on a thread here so the engine can be one that fails."""
    ours, theirs = socket.socketpair()
    child = threading.Thread(target=_child_main, args=(theirs,), daemon=True)
    child.start()
    link = _Link(ours)
    link.send(("recipe", _FailingStepRecipe()))
    ready, = link.receive(block=True)
    assert ready[0] == "ready"
    link.send(("add", "a", [1, 2, 3], {"max_tokens": 10}, 0, None))
    got = []
    while not got or got[-1][0] != "failed":
        got.extend(link.receive(block=True))
    assert got[0][0] == "out" and got[0][1][0].request_id == "a"
    assert "boom" in got[-1][1]
    child.join(5)
    assert not child.is_alive()
    ours.close()
    theirs.close()


@pytest.mark.timeout(60)
def test_the_child_ends_quietly_when_the_parent_hangs_up_mid_stream():
    ours, theirs = socket.socketpair()
    errors = []

    def child():
        try:
            _child_main(theirs)
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(e)

    thread = threading.Thread(target=child, daemon=True)
    thread.start()
    link = _Link(ours)
    link.send(("recipe", recipe(token_ms=2, output_len=100000)))
    assert link.receive(block=True)[0][0] == "ready"
    link.send(("add", "a", [1, 2, 3], {"max_tokens": 100000}, 0, None))
    assert link.receive(block=True)[0][0] == "out"
    ours.close()                          # the gateway went away while the child streams
    thread.join(10)
    assert not thread.is_alive() and errors == []
    theirs.close()


def test_stopped_backend_refuses_new_requests():
    async def main():
        ep = EngineProcess(recipe(token_ms=1), "m")
        with pytest.raises(EngineDeadError, match="not started"):
            ep.add_request("a", [1], {"max_tokens": 1})
        await ep.start()
        await ep.stop()
        with pytest.raises(EngineDeadError):
            ep.add_request("a", [1], {"max_tokens": 1})

    asyncio.run(main())


def test_gateway_serves_through_an_engine_process():
    doc = mock_deployment(token_ms=1, output_len=5)
    doc["server"]["engine_process"] = True
    with running_gateway(doc) as srv:
        assert isinstance(srv.engine(), EngineProcess)
        status, _, body = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 5 and body["choices"][0]["finish_reason"] == "length"
        status, _, raw = srv.request("POST", "/v1/chat/completions",
                                     {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 3, "stream": True})
        events = sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]"
        assert any(e["choices"] and e["choices"][0].get("finish_reason") == "length" for e in events[:-1])
        # a refusal the child makes is a 400 naming the parameter, as a remote replica's is
        status, _, body = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 3, "logprobs": True})
        assert status == 400 and body["error"]["param"] == "logprobs", body


def test_several_engines_in_processes_are_warned_about(monkeypatch, caplog):
    """They step at the same time (in-process engines take turns): the operator is told at start."""
    import logging

    from tokenyard.gateway.backends import engine_pool
    from tokenyard.gateway.config.deployment import parse_deployment

    doc = mock_deployment()
    doc["engines"]["other"] = dict(doc["engines"]["mock"])
    dep = parse_deployment(doc, base_dir=ROOT)
    built = []
    monkeypatch.setattr(engine_pool, "EngineProcess", lambda recipe, name: built.append((recipe, name)) or name)
    with caplog.at_level(logging.WARNING, logger="tokenyard.gateway.backends.engine_pool"):
        handles = engine_pool.load_engines(dep.engines, engine_process=True)
    assert [n for _, n in built] == ["mock", "other"] and handles["other"].engine == "other"
    # The deployment resolves the model path (models/demo-small links to the packaged tokenyard/models/).
    assert built[0][0] == EngineRecipe("mock", MODEL.resolve(), {})
    assert "mock, other each step in a process of their own" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenyard.gateway.backends.engine_pool"):
        handles = engine_pool.load_engines({"mock": dep.engines["mock"]}, engine_process=True)
    assert "at the same time" not in caplog.text


def test_a_torch_engine_in_a_process_answers_as_it_does_on_a_thread():
    """The demo model through the gateway both ways: the same greedy text and logprobs, a JSON schema
    honoured (its grammar compiled in the child) and a schema the grammar library refuses answered 400."""
    doc = {"server": {"access_log": False},
           "engines": {"demo": {"type": "torch", "model": str(ROOT / "models" / "demo-small"), "dtype": "float32",
                                "kv_cache_memory": 8 << 20}}}
    ask = {"model": "demo", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 8,
           "temperature": 0, "logprobs": True, "top_logprobs": 2}
    plain = {k: v for k, v in ask.items() if k not in ("logprobs", "top_logprobs")}
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}}
    answers = {}
    for process in (False, True):
        with running_gateway({**doc, "server": {**doc["server"], "engine_process": process}}) as srv:
            assert isinstance(srv.engine("demo"), EngineProcess) is process
            status, _, body = srv.chat(ask)
            assert status == 200, body
            status, _, structured = srv.chat({**plain, "max_tokens": 40, "response_format": schema})
            assert status == 200, structured
            status, _, refused = srv.chat({**plain, "response_format": {"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}})
            answers[process] = (body, structured, status, refused)
    (thread, t_struct, t_status, t_refused), (proc, p_struct, p_status, p_refused) = answers[False], answers[True]
    assert proc["choices"][0]["message"]["content"] == thread["choices"][0]["message"]["content"]
    lp = [t["logprob"] for t in proc["choices"][0]["logprobs"]["content"]]
    assert lp == pytest.approx([t["logprob"] for t in thread["choices"][0]["logprobs"]["content"]], abs=1e-5)
    assert p_struct["choices"][0]["message"]["content"] == t_struct["choices"][0]["message"]["content"]
    # the grammar held (the demo model's reply may be cut by max_tokens inside the number)
    assert "".join(p_struct["choices"][0]["message"]["content"].split()).startswith('{"n":')
    assert p_status == t_status == 400
    assert p_refused["error"]["param"] == t_refused["error"]["param"] == "response_format"


@pytest.mark.timeout(60)
def test_the_core_freezes_what_its_build_left_before_it_says_ready():
    """The build's live objects go to the collector's permanent generation before ready: full collections
    over them (85 ms for SmolLM2's 180,000 on a 2-core VM) fell on the first requests after ready."""
    import gc
    import inspect

    from tokenyard.engines.serving import engine_core
    gc.unfreeze()
    ours, theirs = socket.socketpair()
    child = threading.Thread(target=_child_main, args=(theirs,), kwargs={"own_process": True}, daemon=True)
    child.start()
    try:
        link = _Link(ours)
        link.send(("recipe", recipe()))
        ready, = link.receive(block=True)
        assert ready[0] == "ready"
        assert gc.get_freeze_count() > 0
        assert "own_process=True" in inspect.getsource(engine_core.main)   # the core's process asks for it
    finally:
        ours.close()
        child.join(10)
        theirs.close()
        gc.unfreeze()       # this test ran the core's loop in the test process: give its objects back
