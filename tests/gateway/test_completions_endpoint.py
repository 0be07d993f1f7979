"""POST /v1/completions (legacy text completion) against a running gateway with the mock engine,
through the openai SDK: string and token-id prompts, stream, stop, max_tokens, usage and the usage
record, refusals naming the parameter, auth, admission; and its place in openapi.json."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from gateway_helpers import KEY, add_key, mock_deployment, running_gateway, sse_events

REPLY = "Tokenyard mock reply"


@pytest.fixture(scope="module")
def srv():
    with running_gateway(mock_deployment()) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=20)


def _prompt_ids(srv, text: str) -> list[int]:
    return srv.gateway.handles["mock"].tokenizer.encode(text)


def test_string_prompt_usage_and_record(client, srv):
    raw = client.completions.with_raw_response.create(model="mock", prompt="Once upon a time",
                                                      extra_headers={"x-request-id": "cmpl-test.1"})
    assert raw.headers["x-tokenyard-engine"] == "mock" and raw.headers["x-tokenyard-route-reason"] == "pinned"
    r = raw.parse()
    assert r.object == "text_completion" and r.id == "cmpl-cmpl-test.1" and r.model == "mock"
    assert r.choices[0].text.startswith(REPLY) and r.choices[0].finish_reason == "stop"
    assert r.choices[0].index == 0 and r.choices[0].logprobs is None
    # No chat template: the prompt is the text encoded as is.
    assert r.usage.prompt_tokens == len(_prompt_ids(srv, "Once upon a time"))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > r.usage.prompt_tokens
    rec = srv.gateway.usage.records[-1]
    assert rec.request_id.startswith("cmpl-test.1") and rec.status == "ok" and rec.engine == "mock"
    assert (rec.prompt_tokens, rec.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_token_id_prompt_counts_the_ids(client):
    r = client.completions.create(model="auto", prompt=[5, 6, 7, 8, 9])
    assert r.usage.prompt_tokens == 5 and r.choices[0].text.startswith(REPLY)
    r = client.completions.create(model="mock", prompt=[[5, 6, 7]])   # a batch of one
    assert r.usage.prompt_tokens == 3


def test_stream_matches_the_full_reply(client):
    full = client.completions.create(model="mock", prompt="Hello")
    chunks = list(client.completions.create(model="mock", prompt="Hello", stream=True,
                                            stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" and c.id.startswith("cmpl-") for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_ends_with_done(srv):
    status, _, raw = srv.request("POST", "/v1/completions", {"model": "mock", "prompt": "Hi", "stream": True})
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" and "text" in e["choices"][0] for e in events[:-1])


def test_max_tokens_and_stop(client):
    r = client.completions.create(model="mock", prompt="Hi", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.completions.create(model="mock", prompt="Hi", stop=["brown", "zzz"])
    assert r.choices[0].text == "Tokenyard mock reply: the quick " and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"echo": True}, "echo"),
    ({"suffix": " the end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 2}, "logprobs"),          # valid, but the mock engine has no distribution to report
    ({"prompt": ["one", ""]}, "prompt"),
    ({"prompt": [["x"]]}, "prompt"),
    ({"prompt": ["p"] * 33}, "prompt"),
    ({"prompt": ["p"] * 8, "n": 9}, "n"),          # 72 choices
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),        # outside the vocabulary
    ({"prompt": "x " * 5000}, "prompt"),    # longer than the context
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"tools": []}, "tools"),
    ({"max_completion_tokens": 3}, "max_completion_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"stop": [""]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_input_is_400_naming_the_parameter(srv, extra, param):
    status, _, body = srv.request("POST", "/v1/completions", {"model": "mock", "prompt": "Hi", **extra})
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == param, err


def test_neutral_values_are_accepted(client):
    r = client.completions.create(model="mock", prompt="Hi", echo=False, suffix=None, best_of=1, n=1,
                                  presence_penalty=0, logit_bias={})
    assert r.choices[0].text.startswith(REPLY)


def test_prompt_is_required_and_model_checked(srv):
    status, _, body = srv.request("POST", "/v1/completions", {"model": "mock"})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
    status, _, body = srv.request("POST", "/v1/completions", {"model": "gpt-17", "prompt": "Hi"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_auth_required(srv):
    bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="nope", max_retries=0, timeout=20)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="mock", prompt="Hi")
    status, _, _ = srv.request("POST", "/v1/completions", {"model": "mock", "prompt": "Hi"},
                               headers={"Authorization": ""})
    assert status == 401


def test_admission_applies():
    doc = {**mock_deployment(token_ms=20, output_len=10, max_sleep_ms=2), "admission": {"max_concurrent_per_tenant": 1}}
    with running_gateway(doc) as srv:
        key = add_key(srv, "capped")
        auth = {"Authorization": f"Bearer {key}"}
        first = threading.Thread(target=srv.request, args=("POST", "/v1/completions",
                                                           {"model": "mock", "prompt": "Hi", "max_tokens": 10}, auth))
        first.start()
        time.sleep(0.05)
        status, headers, body = srv.request("POST", "/v1/completions", {"model": "mock", "prompt": "Hi"}, auth)
        assert status == 429 and json.loads(body)["error"]["code"] == "concurrency_limit_exceeded"
        assert headers["retry-after"]
        first.join(10)
        assert srv.request("POST", "/v1/completions", {"model": "mock", "prompt": "Hi"}, auth)[0] == 200


def test_openapi_lists_the_endpoint(srv):
    doc = json.loads(srv.request("GET", "/openapi.json")[2])
    op = doc["paths"]["/v1/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"prompt", "echo", "suffix", "logprobs", "stop", "stream", "max_tokens"} <= set(props)


def test_logprobs_legacy_shape_with_the_torch_engine():
    from gateway_helpers import ROOT
    doc = {"server": {"access_log": False},
           "engines": {"demo": {"type": "torch", "model": str(ROOT / "models" / "demo-small"), "dtype": "float32",
                                "kv_cache_memory": 8 << 20}}}
    with running_gateway(doc) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6, temperature=0,
                                      logprobs=2)
        lp = r.choices[0].logprobs
        n = r.usage.completion_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
        # Greedy: the chosen token is the most likely one.
        assert all(abs(max(t.values()) - v) < 1e-4 for t, v in zip(lp.top_logprobs, lp.token_logprobs))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        chunks = list(client.completions.create(model="demo", prompt="Once upon a time", max_tokens=6,
                                                temperature=0, logprobs=2, stream=True))
        streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
