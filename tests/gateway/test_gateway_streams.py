"""Slow readers are cut without holding up anyone else; engine failures reach the client."""
from __future__ import annotations

import json
import socket
import threading
import time

import openai
import pytest
from gateway_helpers import KEY, ROOT, mock_deployment, running_gateway, sse_events

from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.serving.mock_engine import MockEngine
from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.config.deployment import Prices

MODEL = ROOT / "models" / "demo-small"


def test_slow_reader_does_not_block_other_streams_and_is_cut():
    doc = mock_deployment(output_len=200_000, max_model_len=400_000, token_ms=0)
    doc["limits"] = {"stream_buffer_bytes": 16384, "stream_write_timeout_s": 0.5}
    with running_gateway(doc) as srv:
        body = json.dumps({"model": "mock", "stream": True, "max_tokens": 200_000,
                           "messages": [{"role": "user", "content": "go"}]}).encode()
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # a tiny window, then never read
        slow.connect(("127.0.0.1", srv.port))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nx-request-id: slowpoke\r\n".encode()
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.2)
        # Meanwhile normal streams are served at full speed.
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=10)
        for _ in range(3):
            t0 = time.perf_counter()
            chunks = list(client.chat.completions.create(model="mock", stream=True, max_tokens=50,
                                                         messages=[{"role": "user", "content": "hi"}]))
            assert time.perf_counter() - t0 < 2.0
            assert chunks[-1].choices[0].finish_reason == "length"
        # The stuck stream is cut as a slow reader: the engine stops working for it.
        deadline = time.monotonic() + 10
        rec = None
        while rec is None and time.monotonic() < deadline:
            rec = next((r for r in srv.gateway.usage.records if r.request_id.startswith("slowpoke-")), None)
            time.sleep(0.02)
        slow.close()
        assert rec is not None and rec.status == "slow_client"
        assert 0 < rec.completion_tokens < 200_000
        s = srv.wait_idle()
        assert s.num_running == 0 and s.num_free_blocks == s.num_total_blocks


class FailingMock(MockEngine):
    """Fails every step once armed (a model that crashes mid-generation)."""

    armed_after = 10 ** 9

    def step(self):
        if self._num_steps >= self.armed_after:
            raise RuntimeError("simulated CUDA error")
        return super().step()


@pytest.fixture()
def failing():
    engine = FailingMock(MODEL, token_ms=5)
    handle = EngineHandle("mock", "mock", AsyncEngine(engine, "mock", max_consecutive_failures=100),
                          engine.tokenizer, Prices(), MODEL, 0)
    with running_gateway(mock_deployment(), handles={"mock": handle}) as srv:
        yield srv, engine


def test_engine_failure_mid_stream_is_an_sse_error_event(failing):
    srv, engine = failing
    engine.armed_after = engine._num_steps + 5
    status, headers, raw = srv.request("POST", "/v1/chat/completions", {
        "model": "mock", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200
    events = sse_events(raw)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "[DONE]" not in events
    err = events[-1]["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error" and "Traceback" not in err["message"]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="mock", stream=True, messages=[{"role": "user", "content": "x"}]))


def test_engine_failure_non_stream_is_500_and_does_not_hang(failing):
    srv, engine = failing
    engine.armed_after = engine._num_steps + 3
    done = threading.Event()
    result = {}

    def call():
        result["r"] = srv.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}]})
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(5), "a failed engine step left the request hanging"
    status, _, body = result["r"]
    assert status == 500 and body["error"]["code"] == "engine_error"
    rec = srv.gateway.usage.records[-1]
    assert rec.status == "error"
