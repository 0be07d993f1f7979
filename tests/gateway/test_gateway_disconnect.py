"""A client that leaves stops its request in the engine: KV blocks freed, usage so far kept.

Runs the real demo-small engine (real KV blocks). Its add_request is wrapped to ignore EOS so
a request surely runs long enough to be cut while generating.
"""
from __future__ import annotations

import json
import socket
import time

import pytest
from gateway_helpers import KEY, ROOT, running_gateway

from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_engine import AsyncEngine
from tokenyard.engines.runtime.engine import Engine
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.backends.engine_pool import EngineHandle
from tokenyard.gateway.config.deployment import Prices

MODEL = ROOT / "models" / "demo-small"
MAX_TOKENS = 400


class LongEngine(Engine):
    def add_request(self, request_id, prompt_token_ids, params=None, priority=0, cache_salt=None):
        assert isinstance(params, SamplingParams)
        params.ignore_eos = True
        super().add_request(request_id, prompt_token_ids, params, priority, cache_salt)


@pytest.fixture(scope="module")
def srv():
    engine = LongEngine(MODEL, kv_cache_memory=16 << 20, progress=False)
    handles = {"demo-small": EngineHandle("demo-small", "torch", AsyncEngine(engine, "demo-small"),
                                          Tokenizer.from_dir(MODEL), Prices(1, 1, 1), MODEL, 0)}
    doc = {"server": {"access_log": False}, "engines": {"demo-small": {"type": "torch", "model": str(MODEL)}}}
    with running_gateway(doc, handles=handles) as s:
        yield s


def _raw_request(port: int, body: dict, request_id: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {KEY}\r\nx-request-id: {request_id}\r\n".encode()
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def _record(srv, request_id: str, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in list(srv.gateway.usage.records):
            if rec.request_id.startswith(request_id + "-"):
                return rec
        time.sleep(0.01)
    raise AssertionError(f"no usage record for {request_id}")


def _wait_running(srv):
    deadline = time.monotonic() + 10
    while srv.engine("demo-small").stats().num_running == 0:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.005)


BODY = {"model": "demo-small", "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": "Copy this text exactly: red green blue"}]}


def test_stream_disconnect_frees_blocks_and_keeps_usage(srv):
    before = srv.engine("demo-small").stats()
    sock = _raw_request(srv.port, {**BODY, "stream": True}, "dc-stream")
    got = b""
    while got.count(b"data: ") < 4:   # the role chunk and a few tokens have arrived
        got += sock.recv(65536)
    assert b"200 OK" in got
    busy = srv.engine("demo-small").stats()
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_total_blocks
    sock.close()
    idle = srv.wait_idle("demo-small")
    assert idle.num_running == 0 and idle.num_free_blocks == idle.num_total_blocks
    rec = _record(srv, "dc-stream")
    assert rec.status == "client_disconnected" and rec.stream
    assert 3 <= rec.completion_tokens < MAX_TOKENS and rec.prompt_tokens > 0
    assert rec.cost_micros == 0 or isinstance(rec.cost_micros, int)
    # Within about one step of noticing: far fewer steps ran than the whole request would need.
    assert idle.num_steps - before.num_steps < MAX_TOKENS // 2


def test_non_stream_disconnect_frees_blocks_and_keeps_usage(srv):
    before = srv.engine("demo-small").stats()
    sock = _raw_request(srv.port, BODY, "dc-plain")
    _wait_running(srv)
    time.sleep(0.05)   # let it generate a few tokens
    sock.close()
    idle = srv.wait_idle("demo-small")
    assert idle.num_running == 0 and idle.num_free_blocks == idle.num_total_blocks
    rec = _record(srv, "dc-plain")
    assert rec.status == "client_disconnected" and not rec.stream
    assert 0 < rec.completion_tokens < MAX_TOKENS
    assert idle.num_steps - before.num_steps < MAX_TOKENS // 2


def test_full_request_still_completes_after_disconnects(srv):
    status, _, body = srv.chat({**BODY, "max_tokens": 8})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["finish_reason"] == "length"
    assert srv.wait_idle("demo-small").num_running == 0
