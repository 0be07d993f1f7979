"""Bad input gets an OpenAI-shaped 4xx, never a stack trace, and leaves nothing behind."""
from __future__ import annotations

import json
import time

import pytest
from gateway_helpers import mock_deployment, running_gateway

GOOD = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def srv():
    doc = mock_deployment()
    doc["limits"] = {"max_body_bytes": 4096, "max_json_depth": 8}
    with running_gateway(doc) as s:
        yield s


def _shape(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    return err


CASES = [
    ("invalid json", b'{"model": "mock", "messages": [', 400, "invalid_json", None),
    ("not utf-8", b'{"model": "mock", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
     "invalid_encoding", None),
    ("body not an object", b'[1, 2]', 400, None, None),
    ("messages wrong type", json.dumps({**GOOD, "messages": "hi"}).encode(), 400, None, "messages"),
    ("empty messages", json.dumps({**GOOD, "messages": []}).encode(), 400, None, "messages"),
    ("unknown role", json.dumps({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, None,
     "messages[0].role"),
    ("content wrong type", json.dumps({**GOOD, "messages": [{"role": "user", "content": 5}]}).encode(), 400, None,
     "messages[0].content"),
    ("image content", json.dumps({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).encode(), 400, "unsupported_parameter",
     "messages[0].content"),
    ("tool message without its call id", json.dumps({**GOOD, "messages": [{"role": "tool", "content": "x"}]}).encode(),
     400, None, "messages[0].tool_call_id"),
    ("function role", json.dumps({**GOOD, "messages": [{"role": "function", "content": "x"}]}).encode(), 400,
     "unsupported_parameter", "messages[0].role"),
    ("stop list over 4", json.dumps({**GOOD, "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, None, "stop"),
    ("stream wrong type", json.dumps({**GOOD, "stream": "yes"}).encode(), 400, None, "stream"),
    ("temperature wrong type", json.dumps({**GOOD, "temperature": "hot"}).encode(), 400, None, "temperature"),
    ("model missing", json.dumps({"messages": GOOD["messages"]}).encode(), 400, None, "model"),
    ("stream_options without stream", json.dumps({**GOOD, "stream_options": {"include_usage": True}}).encode(),
     400, None, "stream_options"),
    ("too deep", json.dumps({**GOOD, "metadata": {"a": [[[[[[[[["x"]]]]]]]]]}}).encode(), 400, "json_too_deep",
     None),
    ("oversized body", json.dumps({**GOOD, "user": "x" * 5000}).encode(), 413, "body_too_large", None),
    ("context too long", json.dumps({**GOOD, "max_tokens": 10 ** 6}).encode(), 400, "context_length_exceeded",
     "max_tokens"),
]


@pytest.mark.parametrize("name, body, status, code, param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_openai_shaped(srv, name, body, status, code, param):
    got, headers, data = srv.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    assert got == status, data
    err = _shape(data)
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    assert headers["x-request-id"]


def test_auth_path_and_method_errors(srv):
    got, _, data = srv.request("POST", "/v1/chat/completions", GOOD, {"Authorization": "Bearer nope"})
    assert got == 401 and _shape(data)["code"] == "invalid_api_key"
    got, _, data = srv.request("POST", "/v1/chat/completions", GOOD, {"Authorization": ""})
    assert got == 401
    got, _, data = srv.request("GET", "/v1/nothing-here")
    assert got == 404 and _shape(data)
    got, _, data = srv.request("GET", "/v1/chat/completions")
    assert got == 405 and _shape(data)
    got, _, data = srv.request("GET", "/v1/models/nope")
    assert got == 404 and _shape(data)["code"] == "model_not_found"


def test_declared_oversized_body_is_refused_before_reading(srv):
    got, _, data = srv.request("POST", "/v1/chat/completions", b"x" * 10, {"content-length": "999999999"})
    assert got == 413 and _shape(data)["code"] == "body_too_large"


def test_nothing_left_behind(srv):
    for _, body, *_ in CASES:
        srv.request("POST", "/v1/chat/completions", body)
    s = srv.wait_idle()
    assert s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks
    deadline = time.monotonic() + 2   # the last request's middleware may still be unwinding
    while srv.gateway.in_progress and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.gateway.in_progress == 0
    # Every case failed before reaching the engine, so no request ran and none was recorded.
    assert len(srv.gateway.usage.records) == 0
    got, _, body = srv.chat(GOOD)  # and the gateway still serves
    assert got == 200 and body["choices"][0]["finish_reason"] == "stop"
