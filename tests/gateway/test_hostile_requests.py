"""One hostile request must not freeze the gateway (issue 46, items 1 and 2): a response_format
whose grammar is slow to compile, or a megabyte prompt, while /health and other requests go on.

The gateway runs demo-small (a real engine, real grammars) or the mock engine; slowness is made
deterministic by making the compile / the tokenizer sleep (a sleep leaves the GIL, as xgrammar's
compiler and HF tokenizers do), and one check uses a real schema that is slow to compile.
"""
from __future__ import annotations

import json
import threading
import time

import pytest
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix

from tokenyard.engines.core.structured_output import Grammars
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.prompt.prompt_guard import INLINE_PROMPT_CHARS, PROMPT_CHARS_PER_TOKEN

DEMO = str(ROOT / "models" / "demo-small")
SIMPLE = {"type": "json_schema", "json_schema": {"name": "point", "schema": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}
# Four strings of 500..4000 letter-digit pairs: 24 s to compile on demo-small's 1,962 tokens (measured).
SLOW_SCHEMA = {"type": "object", "properties": {
    f"p{i}": {"type": "string", "pattern": "^([a-z][0-9]){%d,%d}$" % (500 + i, 4000 + i)} for i in range(4)},
    "required": [f"p{i}" for i in range(4)]}
HEALTH_BOUND_S = 0.5      # generous for a loaded 2-core CI box; the stalls fixed here were seconds


def _demo_doc(**options) -> dict:
    return {"server": {"access_log": False},
            "engines": {"demo": {"type": "torch", "model": DEMO, "dtype": "float32", "kv_cache_memory": 8 << 20,
                                 **options}}}


class HealthProbe:
    """Polls /health from a thread while the test's request runs; keeps the slowest answer."""

    def __init__(self, srv) -> None:
        self.srv, self.worst, self.count = srv, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            status, _, _ = self.srv.request("GET", "/health", timeout=60)
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.count += 1
            assert status == 200
            time.sleep(0.02)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def _chat(srv, body: dict) -> tuple[int, dict]:
    status, _, data = srv.chat({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 4, "temperature": 0, **body})
    return status, data


def test_health_answers_while_a_schema_compiles(monkeypatch):
    """The grammar compiles off the event loop: /health stays fast while a 2 s compile runs."""
    real = Grammars.compile
    slow = {"n": 0}

    seen: set[str] = set()

    def slow_compile(self, fmt):
        """The first compile of each schema takes 2 s more (later calls are cache hits, as for real)."""
        text = json.dumps(fmt, sort_keys=True)
        if fmt.get("type") == "json_schema" and text not in seen:
            seen.add(text)
            slow["n"] += 1
            time.sleep(2.0)
        return real(self, fmt)

    with running_gateway(_demo_doc()) as srv:
        monkeypatch.setattr(Grammars, "compile", slow_compile)
        status, data = _chat(srv, {"response_format": SIMPLE})   # warms the worker (its start is not the point)
        assert status == 200, data
        fresh = json.loads(json.dumps(SIMPLE))
        fresh["json_schema"]["schema"]["properties"]["x"]["maximum"] = 8      # a new schema: compiled again
        with HealthProbe(srv) as probe:
            t0 = time.perf_counter()
            status, data = _chat(srv, {"response_format": fresh})
            took = time.perf_counter() - t0
        assert status == 200, data
        assert data["choices"][0]["message"]["content"].startswith('{"x"'), data   # held to the grammar
        assert took >= 2.0 and slow["n"] >= 2, (took, slow)   # the slow compile did run
        assert probe.count >= 10 and probe.worst < HEALTH_BOUND_S, (probe.count, probe.worst)


@pytest.mark.timeout(180)
def test_a_schema_over_its_compile_budget_is_a_400_naming_response_format():
    """A real schema slow to compile is refused after grammar_compile_timeout_s (its compile is
    killed), /health meanwhile stays fast, and the refusal is remembered."""
    with running_gateway(_demo_doc(grammar_compile_timeout_s=1.0)) as srv:
        status, data = _chat(srv, {"response_format": SIMPLE})   # the worker is up
        assert status == 200, data
        hostile = {"type": "json_schema", "json_schema": {"name": "slow", "schema": SLOW_SCHEMA}}
        with HealthProbe(srv) as probe:
            t0 = time.perf_counter()
            status, data = _chat(srv, {"response_format": hostile})
            took = time.perf_counter() - t0
        assert status == 400, data
        err = data["error"]
        assert err["param"] == "response_format" and err["code"] == "invalid_response_format", err
        assert "too expensive" in err["message"] and "1 s" in err["message"], err
        assert took < 10, took
        assert probe.worst < HEALTH_BOUND_S, probe.worst
        t0 = time.perf_counter()
        status, data = _chat(srv, {"response_format": hostile})    # the verdict is kept: no second compile
        assert status == 400 and time.perf_counter() - t0 < 1.0, data
        status, data = _chat(srv, {"response_format": SIMPLE})     # a fresh worker serves the next one
        assert status == 200, data


def _tools_body(n_tools: int, words: int) -> dict:
    desc = " ".join(["describe"] * words)
    tools = [{"type": "function", "function": {"name": f"f{i}", "description": desc,
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(n_tools)]
    return {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 4}


def test_a_megabyte_prompt_is_refused_before_tokenising(monkeypatch):
    """100 tools of 1,100 words (~1 MB, under the 1 MiB body limit): 400 context_length_exceeded at
    once, the tokenizer never called."""
    calls = {"n": 0}
    real = Tokenizer.encode

    def counting_encode(self, *a, **k):
        calls["n"] += 1
        return real(self, *a, **k)

    with running_gateway(mock_deployment(max_sleep_ms=5)) as srv:
        monkeypatch.setattr(Tokenizer, "encode", counting_encode)
        body = _tools_body(100, 1100)
        assert len(json.dumps(body)) > 900_000
        t0 = time.perf_counter()
        status, _, raw = srv.request("POST", "/v1/chat/completions", body)
        took = time.perf_counter() - t0
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", err
        assert "not tokenised" in err["message"] and calls["n"] == 0, (err, calls)
        assert took < 1.0, took
        # Just under the cap it is tokenised (and then too long for the context, counted in tokens).
        ctx = srv.engine().max_model_len
        small = {"model": "mock", "max_tokens": 4,
                 "messages": [{"role": "user", "content": "a b " * (ctx * PROMPT_CHARS_PER_TOKEN // 4 - 8)}]}
        status, _, raw = srv.request("POST", "/v1/chat/completions", small)
        err = json.loads(raw)["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and "tokens" in err["message"], err
        assert calls["n"] >= 1 and "not tokenised" not in err["message"]


def test_health_answers_while_a_prompt_is_tokenised(monkeypatch):
    """Templating and tokenising a prompt longer than INLINE_PROMPT_CHARS run on the prompt threads: a
    1.5 s encode does not stall /health. (A shorter prompt is encoded on the loop: tens of microseconds.)"""
    real = Tokenizer.encode
    slow = {"on": False}

    def slow_encode(self, *a, **k):
        if slow["on"]:
            time.sleep(1.5)
        return real(self, *a, **k)

    with running_gateway(mock_deployment(max_sleep_ms=5)) as srv:
        monkeypatch.setattr(Tokenizer, "encode", slow_encode)
        slow["on"] = True
        with HealthProbe(srv) as probe:
            status, _, data = srv.chat({"model": "mock", "max_tokens": 4, "messages": [
                {"role": "user", "content": "hi " * (INLINE_PROMPT_CHARS // 3 + 1)}]})
        assert status == 200, data
        assert probe.count >= 10 and probe.worst < HEALTH_BOUND_S, (probe.count, probe.worst)


def test_a_short_prompt_is_encoded_on_the_loop_without_a_thread_hop(monkeypatch):
    """Each hop to the prompt threads costs more than encoding a short chat: none is taken for one."""
    from tokenyard.gateway.prompt import prompt_guard
    hops = []
    real = prompt_guard.off_loop

    async def counting(fn, *args):
        hops.append(fn)
        return await real(fn, *args)
    monkeypatch.setattr(prompt_guard, "off_loop", counting)
    with running_gateway(mock_deployment(max_sleep_ms=5)) as srv:
        status, _, data = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert status == 200 and hops == [], (data, hops)
        status, _, data = srv.chat({"model": "mock", "max_tokens": 4, "messages": [
            {"role": "user", "content": "x " * (INLINE_PROMPT_CHARS // 2 + 10)}]})
        assert status == 200 and len(hops) >= 1, (data, hops)


def test_refused_long_prompts_count_against_the_request_limit():
    """A flood of over-long prompts is rate limited (429) like any other requests."""
    prefix = unique_prefix("hostile")
    doc = {**mock_deployment(max_sleep_ms=5), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"requests": 3, "tokens": 1_000_000, "window_s": 60}}
    try:
        with running_gateway(doc) as srv:
            body = _tools_body(100, 1100)
            statuses = [srv.request("POST", "/v1/chat/completions", body)[0] for _ in range(5)]
            assert statuses[:3] == [400, 400, 400] and statuses[3:] == [429, 429], statuses
            # A tokenised prompt over the context is charged the same way: the limit is spent.
            status, _, _ = srv.chat({"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert status == 429
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_refused_long_prompts_never_label_metrics_with_the_clients_model_name():
    """The model string of a prompt refused before routing is the client's: metrics carry a fixed label."""
    prefix = unique_prefix("hostile")
    doc = {**mock_deployment(max_sleep_ms=5), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
           "rate_limits": {"requests": 1, "tokens": 1_000_000, "window_s": 60}}
    try:
        with running_gateway(doc) as srv:
            for i in range(4):
                body = {**_tools_body(100, 1100), "model": f"zz-made-up-{i}"}
                srv.request("POST", "/v1/chat/completions", body)
            text = srv.request("GET", "/metrics")[2].decode()
            assert "zz-made-up" not in text
            assert 'tokenyard_rate_limited_total{engine="(unrouted)"' in text
    finally:
        delete_prefix(SHARED_REDIS, prefix)
