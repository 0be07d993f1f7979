"""The real openai SDK against a running gateway (mock engine, and the real demo-small engine)."""
from __future__ import annotations

import openai
import pytest
from gateway_helpers import KEY, ROOT, mock_deployment, running_gateway

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def mock_server():
    with running_gateway(mock_deployment()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(mock_server):
    return openai.OpenAI(base_url=mock_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=20)


def test_non_stream_completion_usage_and_headers(client, mock_server):
    raw = client.chat.completions.with_raw_response.create(model="mock", messages=MESSAGES,
                                                           extra_headers={"x-request-id": "req-abc.1"})
    assert raw.headers["x-tokenyard-engine"] == "mock"
    assert raw.headers["x-tokenyard-route-reason"] == "pinned"
    assert raw.headers["x-request-id"] == "req-abc.1"
    r = raw.parse()
    assert r.model == "mock" and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.startswith("Tokenyard mock reply")
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0
    rec = mock_server.gateway.usage.records[-1]
    assert rec.request_id.startswith("req-abc.1") and rec.status == "ok"
    assert (rec.prompt_tokens, rec.completion_tokens) == (u.prompt_tokens, u.completion_tokens)


def test_stream_with_include_usage(client):
    chunks = list(client.chat.completions.create(model="auto", messages=MESSAGES, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    with_choices = [c for c in chunks if c.choices]
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    deltas = [c.choices[0].delta.content or "" for c in with_choices]
    assert all("\ufffd" not in d for d in deltas)
    text = "".join(deltas)
    full = client.chat.completions.create(model="auto", messages=MESSAGES)
    assert text == full.choices[0].message.content  # the mock reply holds multi-byte characters
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_max_tokens_and_stop(client):
    r = client.chat.completions.create(model="mock", messages=MESSAGES, max_completion_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="mock", messages=MESSAGES, stop=["brown", "zzz"])
    assert r.choices[0].message.content == "Tokenyard mock reply: the quick "
    assert r.choices[0].finish_reason == "stop"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": "auto"}, "tool_choice"),       # without tools
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
])
def test_unsupported_parameters_are_400_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mock", messages=MESSAGES, **extra)
    assert e.value.body["param"] == param and param in e.value.body["message"]


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"extra_body": {"bogus": 1}}, "bogus"),
])
def test_bad_parameters_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="mock", messages=MESSAGES, **extra)
    assert e.value.body["param"] == param


def test_neutral_values_of_unsupported_parameters_pass(client):
    r = client.chat.completions.create(model="mock", messages=MESSAGES, n=1, presence_penalty=0, logprobs=False,
                                       user="u1", metadata={"team": "a"}, seed=3, temperature=0.5, top_p=0.9)
    assert r.choices[0].finish_reason == "stop"


def test_bad_key_is_401_and_models_list(mock_server, client):
    bad = openai.OpenAI(base_url=mock_server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="mock", messages=MESSAGES)
    assert e.value.body["code"] == "invalid_api_key"
    assert [m.id for m in client.models.list()] == ["auto", "mock"]
    assert client.models.retrieve("mock").id == "mock"


def test_real_engine_streamed_equals_non_streamed_under_greedy():
    doc = {"server": {"access_log": False}, "engines": {"demo-small": {
        "type": "torch", "model": str(ROOT / "models" / "demo-small"), "kv_cache_memory": 16 << 20}}}
    with running_gateway(doc) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for prompt in ("Add 12 and 30.", "Reverse the order of these words: red sun", "Count the letters in café ✓"):
            msgs = [{"role": "user", "content": prompt}]
            full = c.chat.completions.create(model="demo-small", messages=msgs, temperature=0, max_tokens=40)
            chunks = list(c.chat.completions.create(model="auto", messages=msgs, temperature=0, max_tokens=40,
                                                    stream=True, stream_options={"include_usage": True}))
            deltas = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
            assert all("\ufffd" not in d for d in deltas)
            assert "".join(deltas) == full.choices[0].message.content
            assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
            assert chunks[-1].model == "demo-small"
        # The same prompt again is served partly from the prefix cache, and usage says so.
        long = [{"role": "user", "content": "Copy this text exactly: " + "alpha beta gamma delta " * 6}]
        c.chat.completions.create(model="demo-small", messages=long, temperature=0, max_tokens=2)
        again = c.chat.completions.create(model="demo-small", messages=long, temperature=0, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens >= 16
        assert srv.wait_idle("demo-small").num_running == 0
