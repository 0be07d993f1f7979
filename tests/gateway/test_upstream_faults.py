"""Upstream engines (type: openai) against faulty deployments (issue 48): a small in-test
OpenAI-compatible server per deployment (aiohttp on a thread, one port each) whose behaviour a test
sets (`fake.mode`), in front of a Tokenyard gateway driven by the openai SDK and raw HTTP.

What must hold: a failure before the first token is retried on another deployment and cools the
failed one down (Retry-After honoured, a trial brings it back); when every deployment fails the
client gets an OpenAI-shaped 502/503/504/429 naming the engine, never a 500, a URL or the key; a
failure after the first chunk ends the stream with one error event and is never retried or billed
twice; missing usage is estimated; the key reaches the upstream and nothing else; a deployment
down at start-up does not stop the gateway; a policy fallback moves the request to another engine.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable

import pytest
from gateway_helpers import AUTH, KEY, ROOT, running_gateway

from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment

openai = pytest.importorskip("openai")
web = pytest.importorskip("aiohttp.web")

UPSTREAM_KEY = "sk-upstream-0123456789abcdef-SECRET"
KEY_ENV = "TY_TEST_FAULT_UPSTREAM_KEY"
PRICES = {"input": 1_000_000, "cached_input": 500_000, "output": 2_000_000}
FIRST_TOKEN_S = 0.4
TEXT = ["Hello", " there", " friend"]


class FakeUpstream:
    """One deployment: /v1/chat/completions and /v1/models, misbehaving as `mode` says.

    Modes: ok, nousage (no usage anywhere), 429 (Retry-After: `retry_after`), 500, 500_echo (the error
    message echoes the Authorization header), reset (close the socket after `after` chunks), slow
    (head sent, first event after `delay` s), slow_head (head after `delay` s), malformed (the first
    event is not JSON), garbage (a 200 that holds no event), error_first (an error event first),
    error_mid (an error event after `after` chunks)."""

    def __init__(self) -> None:
        self.port = 0
        self.reset()

    def reset(self) -> None:
        self.mode = "ok"
        self.models_status = 200
        self.retry_after = "1"
        self.after = 1
        self.delay = 3 * FIRST_TOKEN_S
        # reset: the socket closes only once the test has seen the chunks before it (else the gateway
        # may find the reset before it read them, which is a failure before the first event: retried)
        self.gate = threading.Event()
        self.calls: list[dict[str, Any]] = []      # chat calls: {"auth": ..., "body": ..., "at": monotonic}
        self.model_calls: list[str | None] = []    # the Authorization header of each GET /models

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def models(self, request: Any) -> Any:
        self.model_calls.append(request.headers.get("Authorization"))
        if self.models_status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.models_status)
        return web.json_response({"object": "list", "data": [{"id": "up-model", "object": "model"}]})

    async def chat(self, request: Any) -> Any:
        body = await request.json()
        auth = request.headers.get("Authorization")
        self.calls.append({"auth": auth, "body": body, "at": time.monotonic()})
        mode = self.mode
        if mode == "429":
            return web.json_response({"error": {"message": "slow down", "type": "rate_limit"}}, status=429,
                                     headers={"Retry-After": self.retry_after})
        if mode == "500":
            return web.json_response({"error": {"message": "the upstream fell over"}}, status=500)
        if mode == "500_echo":
            return web.json_response({"error": {"message": f"internal error handling request with {auth}"}},
                                     status=500)
        if mode == "slow_head":
            await asyncio.sleep(self.delay)
        prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])) + 3
        usage = {"prompt_tokens": prompt, "completion_tokens": len(TEXT), "total_tokens": prompt + len(TEXT)}
        if not body.get("stream"):
            doc = {"id": "up-1", "object": "chat.completion", "created": 1, "model": body["model"],
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(TEXT)},
                                "finish_reason": "stop"}]}
            if mode != "nousage":
                doc["usage"] = usage
            return web.json_response(doc)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(doc: Any) -> None:
            await resp.write(b"data: " + (doc if isinstance(doc, bytes) else json.dumps(doc).encode()) + b"\n\n")

        def chunk(i: int) -> dict[str, Any]:
            return {"id": "up-1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                    "choices": [{"index": 0, "delta": {"content": TEXT[i]},
                                 "finish_reason": "stop" if i == len(TEXT) - 1 else None}]}
        if mode == "slow":
            await asyncio.sleep(self.delay)
        if mode == "malformed":
            await event(b'{"id": "up-1", "choices": [ {oops')
        if mode == "garbage":
            await resp.write(b"<html>not an event stream</html>\n")
            await resp.write_eof()
            return resp
        if mode == "error_first":
            await event({"error": {"message": "overloaded", "type": "server_error"}})
        for i in range(len(TEXT)):
            if i == self.after and mode == "reset":
                deadline = time.monotonic() + 5
                while not self.gate.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                request.transport.close()          # the connection drops mid-stream, no terminating chunk
                return resp
            if i == self.after and mode == "error_mid":
                await event({"error": {"message": "the model crashed", "type": "server_error"}})
            await event(chunk(i))
        if (body.get("stream_options") or {}).get("include_usage") and mode != "nousage":
            await event({"id": "up-1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                         "choices": [], "usage": usage})
        await event(b"[DONE]")
        await resp.write_eof()
        return resp


class Upstreams:
    """Three fake deployments on one event loop in a thread."""

    def __init__(self, n: int = 3) -> None:
        self.fakes = [FakeUpstream() for _ in range(n)]
        self.loop = asyncio.new_event_loop()
        self.runners: list[Any] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        for fake in self.fakes:
            app = web.Application()
            app.router.add_get("/v1/models", fake.models)
            app.router.add_post("/v1/chat/completions", fake.chat)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            fake.port = runner.addresses[0][1]
            self.runners.append(runner)

    def close(self) -> None:
        async def stop() -> None:
            for r in self.runners:
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def upstreams():
    ups = Upstreams()
    try:
        yield ups.fakes
    finally:
        ups.close()


@pytest.fixture
def fakes(upstreams, monkeypatch):
    for f in upstreams:
        f.reset()
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    return upstreams


def closed_port() -> int:
    """A port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def big_engine(urls: list[str], **extra: Any) -> dict[str, Any]:
    return {"type": "openai", "base_urls": urls, "upstream_model": "up-model", "api_key_env": KEY_ENV,
            "prices": PRICES, "timeouts": {"connect_s": 1, "first_token_s": FIRST_TOKEN_S, "between_tokens_s": 1,
                                           "total_s": 5},
            "cooldown_s": 0.2, "max_cooldown_s": 5, "health_interval_s": 0.2, "backoff_s": 0.01, **extra}


@contextmanager
def front(urls: list[str], *, access_log: bool = False, extra_engines: dict | None = None, health: bool = True,
          big: dict | None = None, **doc_extra: Any):
    """A gateway with engine "big" on `urls`; yields (running, openai client, usage records).
    health=False: the periodic health checks do nothing, so only requests move a deployment's state."""
    records: list[Any] = []
    doc = {"server": {"access_log": access_log}, "engines": {"big": big_engine(urls, **(big or {})), **(extra_engines or {})},
           **doc_extra}
    with running_gateway(doc, usage_sink=records.append) as srv:
        if not health:
            async def no_checks(every: bool) -> None:
                return None
            srv.gateway.handles["big"].engine.check_all = no_checks
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)
        yield srv, client, records


def engine(srv: Any, name: str = "big") -> Any:
    return srv.gateway.handles[name].engine


def metric(srv: Any, name: str, **labels: str) -> float:
    """A sample of /metrics (0 when absent)."""
    status, _, body = srv.request("GET", "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if not line.startswith(name + "{"):
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return 0.0


def label(fake: FakeUpstream) -> str:
    return f"127.0.0.1:{fake.port}"


def ask(client: Any, stream: bool = False, **kw: Any) -> Any:
    args = {"model": "big", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 8, **kw}
    if stream:
        return list(client.chat.completions.create(stream=True, **args))
    return client.chat.completions.create(**args)


def until_tried(fake: FakeUpstream, send: Callable[[], Any], most: int = 6) -> list[Any]:
    """Send requests (each must succeed) until `fake` has seen a call: the pick among healthy
    deployments is round-robin, so which one a request tries first is not fixed."""
    out = []
    for _ in range(most):
        out.append(send())
        if fake.calls:
            return out
    raise AssertionError(f"deployment {label(fake)} was never tried in {most} requests")


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def stream_raw(srv: Any, on_first: Callable[[], Any] = lambda: None, **kw: Any) -> tuple[int, list[Any]]:
    """A streamed chat request read event by event; on_first() runs once the first event is in."""
    body = json.dumps({"model": "big", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 8,
                       "stream": True, **kw})
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=AUTH)
        resp = conn.getresponse()
        events: list[Any] = []
        while True:
            line = resp.readline()
            if not line:
                return resp.status, events
            if line.startswith(b"data: "):
                data = line[6:].strip().decode()
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    on_first()
    finally:
        conn.close()


# -- a failure before the first token: retried elsewhere, the deployment cooled down ----------------
@pytest.mark.parametrize("mode", ["500", "refused"])
def test_failed_deployment_is_retried_elsewhere_and_cooled_down(fakes, mode):
    bad, good = fakes[0], fakes[1]
    bad_url = f"http://127.0.0.1:{closed_port()}/v1" if mode == "refused" else bad.url
    bad.mode = "500"
    with front([bad_url, good.url]) as (srv, client, records):
        bad_label = bad_url.split("/")[2]
        if mode == "refused":
            # Down since start-up (its first health check cooled it down): requests go to the other
            # until its pause ends, then one of them is its trial, which fails over too.
            deadline = time.monotonic() + 5
            while not metric(srv, "tokenyard_upstream_attempts_total", deployment=bad_label):
                assert time.monotonic() < deadline, "the refused deployment never had a trial"
                ask(client)
                time.sleep(0.02)
        else:
            until_tried(bad, lambda: ask(client))
        # every request succeeded (ask raises otherwise); the one that met the bad deployment took two attempts
        assert any(r.upstream_attempts == 2 and r.upstream_deployment == label(good) for r in records)
        assert all(r.status == "ok" and r.upstream_deployment == label(good) for r in records)
        outcome = "connect_error" if mode == "refused" else "server_error"
        assert metric(srv, "tokenyard_upstream_attempts_total", engine="big", deployment=bad_label,
                      outcome=outcome) >= 1
        assert metric(srv, "tokenyard_upstream_cooldowns_total", engine="big", deployment=bad_label) >= 1
        assert metric(srv, "tokenyard_upstream_attempts_total", engine="big", deployment=label(good),
                      outcome="ok") == len(records)


def test_429_retry_after_is_honoured_then_a_trial_brings_it_back(fakes):
    limited, good = fakes[0], fakes[1]
    limited.mode, limited.retry_after = "429", "1"
    with front([limited.url, good.url], health=False) as (srv, client, records):
        until_tried(limited, lambda: ask(client))
        hit = limited.calls[0]["at"]
        dep = engine(srv).deployments[0]
        assert dep.state == "cooling" and dep.pause_s == pytest.approx(1.0)
        limited.mode = "ok"
        # During its pause every request goes to the other deployment.
        while time.monotonic() < hit + 0.8:
            assert ask(client).choices[0].message.content == "".join(TEXT)
            time.sleep(0.05)
        assert len(limited.calls) == 1
        assert all(r.upstream_deployment == label(good) for r in records)
        # After it (1 s, up to 10 % jitter) the next request is its trial, and it is back.
        assert hit + 1.0 <= dep.until <= hit + 1.2
        time.sleep(max(0.0, dep.until - time.monotonic()) + 0.01)
        ask(client)
        assert len(limited.calls) == 2 and records[-1].upstream_deployment == label(limited)
        assert dep.state == "up" and dep.pause_s == 0
        assert metric(srv, "tokenyard_upstream_deployment_up", engine="big", deployment=label(limited)) == 1


def test_failed_trial_doubles_the_pause(fakes):
    bad, good = fakes[0], fakes[1]
    bad.mode = "500"
    with front([bad.url, good.url], health=False) as (srv, client, _):
        until_tried(bad, lambda: ask(client))
        dep = engine(srv).deployments[0]
        assert dep.state == "cooling" and dep.pause_s == pytest.approx(0.2)
        time.sleep(max(0.0, dep.until - time.monotonic()) + 0.01)
        ask(client)                                 # the trial: fails, answered by the other
        assert len(bad.calls) == 2 and dep.state == "cooling" and dep.pause_s == pytest.approx(0.4)


# -- every deployment failing: an OpenAI-shaped error naming the engine ---------------------------
@pytest.mark.parametrize("mode,status,error", [("500", 502, openai.APIStatusError),
                                                ("429", 429, openai.RateLimitError),
                                                ("slow_head", 504, openai.APIStatusError),
                                                ("refused", 502, openai.APIStatusError)])
def test_all_deployments_failing_is_an_openai_error(fakes, mode, status, error):
    for f in fakes[:2]:
        f.mode = mode
    urls = [f"http://127.0.0.1:{closed_port()}/v1" for _ in range(2)] if mode == "refused" else \
        [f.url for f in fakes[:2]]
    # slow_head: a non-streamed reply waits up to total_s; keep it short here. No health checks: only
    # requests move the deployments' state.
    timeouts = {"connect_s": 1, "first_token_s": FIRST_TOKEN_S, "between_tokens_s": 1, "total_s": FIRST_TOKEN_S}
    with front(urls, health=False, big={"timeouts": timeouts}) as (srv, client, records):
        if mode == "refused":
            wait_for(lambda: not engine(srv).dead)          # down since start-up: wait for the pause to end
        with pytest.raises(error) as e:
            ask(client)
        assert e.value.status_code == status
        err = e.value.body
        assert isinstance(err, dict) and err["message"] and err["code"]
        assert "big" in err["message"]
        for secret in ("127.0.0.1", *(u.split(":")[-1].split("/")[0] for u in urls), UPSTREAM_KEY, "/v1"):
            assert secret not in err["message"]
        if mode == "429":
            assert int(e.value.response.headers["retry-after"]) >= 1
        # Every deployment is now cooling: the next request is refused up front, never a 500.
        for _ in range(2):
            code, _, doc = srv.chat({"model": "big", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
            assert code in (429, 502, 503, 504) and "error" in doc and "big" in doc["error"]["message"]
        assert not records or all(r.status != "ok" for r in records)


def test_upstream_error_text_never_leaks_the_key(fakes):
    """An upstream that echoes the request's Authorization header in its error message."""
    for f in fakes[:2]:
        f.mode = "500_echo"
    with front([f.url for f in fakes[:2]]) as (srv, client, _):
        with pytest.raises(openai.APIStatusError) as e:
            ask(client)
        assert e.value.status_code == 502 and "big" in e.value.message
        assert UPSTREAM_KEY not in json.dumps(e.value.body) and UPSTREAM_KEY not in e.value.message


# -- a failure after the first chunk: one error event, no retry, billed once ----------------------
@pytest.mark.parametrize("mode", ["reset", "error_mid"])
def test_failure_mid_stream_ends_the_stream_once(fakes, mode):
    for f in fakes[:2]:
        f.mode, f.after = mode, 1
    with front([f.url for f in fakes[:2]]) as (srv, client, records):
        status, events = stream_raw(srv, on_first=lambda: [f.gate.set() for f in fakes])
        assert status == 200
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and events[-1] is errors[0] and "[DONE]" not in events
        assert events[0]["choices"][0]["delta"]["content"] == TEXT[0] and events[0]["model"] == "big"
        assert "big" in errors[0]["error"]["message"] and "127.0.0.1" not in errors[0]["error"]["message"]
        assert sum(len(f.calls) for f in fakes) == 1            # never retried
        wait_for(lambda: len(records) >= 1)
        time.sleep(0.05)
        assert len(records) == 1 and records[0].status == "error" and records[0].upstream_attempts == 1
        # The SDK sees the error event as an error, after the first chunk.
        for f in fakes:
            f.gate.clear()
        chunks: list[Any] = []
        with pytest.raises(openai.APIError):
            for c in client.chat.completions.create(model="big", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=8, stream=True):
                chunks.append(c)
                for f in fakes:
                    f.gate.set()
        assert len(chunks) == 1 and sum(len(f.calls) for f in fakes) == 2


# -- a failure before the first event of a stream: retried ------------------------------------------
@pytest.mark.parametrize("mode", ["slow", "slow_head", "malformed", "garbage", "error_first"])
def test_stream_failing_before_its_first_event_is_retried(fakes, mode):
    bad, good = fakes[0], fakes[1]
    bad.mode = mode
    with front([bad.url, good.url]) as (srv, client, records):
        results = until_tried(bad, lambda: ask(client, stream=True, stream_options={"include_usage": True}))
        for chunks in results:
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(TEXT)
            assert [c.usage.completion_tokens for c in chunks if c.usage] == [len(TEXT)]
        assert records[-1].upstream_attempts == 2 and records[-1].upstream_deployment == label(good)
        assert records[-1].status == "ok" and len(records) == len(results)
        assert metric(srv, "tokenyard_upstream_cooldowns_total", engine="big", deployment=label(bad)) >= 1
        if mode.startswith("slow"):
            assert metric(srv, "tokenyard_upstream_attempts_total", engine="big", deployment=label(bad),
                          outcome="timeout") == 1


# -- usage -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_missing_usage_is_estimated(fakes, stream):
    fakes[0].mode = "nousage"
    with front([fakes[0].url]) as (srv, client, records):
        r = ask(client, stream=stream)
        if not stream:
            assert r.choices[0].message.content == "".join(TEXT) and r.usage is None
        rec = records[-1]
        assert rec.usage_estimated and rec.status == "ok"
        assert rec.prompt_tokens > 0 and rec.completion_tokens > 0
        assert rec.cost_micros == (rec.prompt_tokens * PRICES["input"] + rec.completion_tokens * PRICES["output"]) \
            // 10**6


def test_reported_usage_is_not_estimated(fakes):
    with front([fakes[0].url]) as (srv, client, records):
        ask(client, stream=True)
        rec = records[-1]
        assert not rec.usage_estimated and rec.completion_tokens == len(TEXT)
        assert fakes[0].calls[-1]["body"]["stream_options"] == {"include_usage": True}


# -- the key ----------------------------------------------------------------------------------------
def test_key_goes_to_the_upstream_and_nowhere_else(fakes, caplog):
    caplog.set_level(logging.INFO, logger="tokenyard.access")
    fakes[0].mode = "500_echo"
    with front([f.url for f in fakes[:2]], access_log=True) as (srv, client, records):
        until_tried(fakes[0], lambda: ask(client))
        ask(client, stream=True)
        status, _, models = srv.request("GET", "/v1/models")
        assert status == 200 and b"big" in models
        _, _, metrics_text = srv.request("GET", "/metrics")
        fakes[1].mode = "500_echo"
        fakes[0].mode = "500_echo"
        code, _, err = srv.chat({"model": "big", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4})
    assert code in (502, 503)
    sent = [c["auth"] for f in fakes[:2] for c in f.calls] + [a for f in fakes[:2] for a in f.model_calls]
    assert sent and all(a == f"Bearer {UPSTREAM_KEY}" for a in sent)
    access = [r.getMessage() for r in caplog.records if r.name == "tokenyard.access"]
    assert len(access) >= 4
    everything = [models.decode(), metrics_text.decode(), json.dumps(err), *access,
                  *(r.getMessage() for r in caplog.records), *(repr(r) for r in records),
                  repr(srv.gateway.deployment.engines)]
    for text in everything:
        assert UPSTREAM_KEY not in text and "0123456789abcdef" not in text


# -- start-up ---------------------------------------------------------------------------------------
def test_deployment_down_at_start_does_not_stop_the_gateway(fakes):
    down = f"http://127.0.0.1:{closed_port()}/v1"
    fakes[2].models_status = 503          # answers, but not healthy
    with front([down, fakes[0].url, fakes[2].url], health=False) as (srv, client, records):
        deps = engine(srv).deployments
        assert [d.state for d in deps] == ["cooling", "up", "cooling"]
        assert metric(srv, "tokenyard_upstream_deployment_up", engine="big", deployment=down.split("/")[2]) == 0
        assert engine(srv).dead is None
        for _ in range(3):
            assert ask(client).choices[0].message.content == "".join(TEXT)
        assert all(r.upstream_deployment == label(fakes[0]) for r in records)


def test_deployment_that_comes_up_later_joins(fakes):
    fakes[1].models_status = 503
    fakes[1].mode = "500"
    with front([fakes[0].url, fakes[1].url]) as (srv, client, _):
        dep = engine(srv).deployments[1]
        assert dep.state == "cooling"
        fakes[1].models_status, fakes[1].mode = 200, "ok"
        wait_for(lambda: dep.state == "up")                   # the health check brought it back
        for _ in range(4):
            ask(client)
        assert fakes[1].calls


@pytest.mark.parametrize("change,needle", [
    ({"type": "vllm"}, "type must be one of"),
    ({"api_key_env": "TY_TEST_FAULT_NOT_SET"}, "TY_TEST_FAULT_NOT_SET is not set"),
    ({"api_key": "sk-inline"}, "never write the key"),
    ({"base_urls": ["http://user:pw@127.0.0.1:1/v1"]}, "without credentials"),
])
def test_bad_engine_config_names_the_engine(monkeypatch, change, needle):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    monkeypatch.delenv("TY_TEST_FAULT_NOT_SET", raising=False)
    spec = {**big_engine(["http://127.0.0.1:1/v1"]), **change}
    with pytest.raises(DeploymentError) as e:
        parse_deployment({"engines": {"big": spec}}, base_dir=ROOT)
    assert "big" in str(e.value) and needle in str(e.value)
    assert "sk-inline" not in str(e.value) and UPSTREAM_KEY not in str(e.value) and "pw" not in str(e.value)


# -- policy fallback ------------------------------------------------------------------------------
POLICY = """\
version: 1
engines: {small: other, large: big}
prices:
  big: {input: 1, cached_input: 0.5, output: 2}
  other: {input: 0.05, cached_input: 0.01, output: 0.2}
tenants:
  "*":
    fallback: {engines: [other], on: [error]}
"""


def test_policy_fallback_moves_the_request_to_another_engine(fakes, tmp_path):
    for f in fakes[:2]:
        f.mode = "500"
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    other = {"other": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}
    with front([f.url for f in fakes[:2]], extra_engines=other, policy=str(policy)) as (srv, client, records):
        raw = client.chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        r = raw.parse()
        assert raw.headers["x-tokenyard-engine"] == "other"
        assert raw.headers["x-tokenyard-route-reason"].startswith("fallback_")
        assert r.model == "other" and r.choices[0].message.content is not None
        assert sum(len(f.calls) for f in fakes[:2]) == 2           # both of big's deployments were tried
        assert records[-1].engine == "other" and records[-1].route_reason == "fallback_error"
        assert metric(srv, "tokenyard_upstream_fallbacks_total", engine="big") == 1
        # A streamed request falls back the same way (once big's deployments may take a trial again).
        wait_for(lambda: engine(srv).dead is None)
        chunks = ask(client, stream=True)
        assert chunks and all(c.model == "other" for c in chunks)
        assert records[-1].engine == "other" and records[-1].route_reason == "fallback_error"


def test_policy_fallback_while_every_deployment_cools_down(fakes, tmp_path):
    for f in fakes[:2]:
        f.mode, f.models_status = "500", 503
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    other = {"other": {"type": "mock", "model": str(ROOT / "models" / "demo-small")}}
    with front([f.url for f in fakes[:2]], extra_engines=other, policy=str(policy),
               big={"cooldown_s": 30, "max_cooldown_s": 60}) as (srv, client, _):
        assert engine(srv).dead is not None               # both failed their start-up health check
        raw = client.chat.completions.with_raw_response.create(
            model="big", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
        assert raw.headers["x-tokenyard-engine"] == "other"
