"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) driven by the real anthropic
SDK against a gateway with mock engines: the same flow as chat (key, limits, routing, spend), the
reply, its event stream, tool use, Anthropic's error shape."""
from __future__ import annotations

import json

import anthropic
import pytest
import redis
from gateway_helpers import KEY, ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix

from tokenyard.gateway.auth.api_keys import KeyStore
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.edge.messages_request import parse_messages_request

MODEL_DIR = str(ROOT / "models" / "demo-small")
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}},
           "cache_control": {"type": "ephemeral"}}
HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def srv():
    records = []
    doc = {"server": {"access_log": False}, "engines": {
        # 4 prompt tokens reported as prefix-cache hits: Anthropic's usage splits them out of input_tokens
        "mock": {"type": "mock", "model": MODEL_DIR, "max_sleep_ms": 2, "cached_tokens": 4},
        # a model whose reply is always a call to get_weather (the tool-call parser reads it as one)
        "caller": {"type": "mock", "model": MODEL_DIR, "max_sleep_ms": 2, "reply": CALL}}}
    with running_gateway(doc, usage_sink=records.append) as s:
        s.records = records
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.base_url, api_key=KEY, max_retries=0, timeout=30)


def _record(srv, message_id: str):
    rid = message_id.removeprefix("msg_")
    return next(r for r in srv.records if r.client_request_id == rid)


def test_create_answers_a_message_with_usage_and_a_spend_record_tagged_messages(srv, client):
    m = client.messages.create(model="mock", max_tokens=8, system=[{"type": "text", "text": "Be brief."}],
                               messages=HI, metadata={"user_id": "u-42"})
    assert m.type == "message" and m.role == "assistant" and m.model == "mock" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.startswith("Tokenyard mock")
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    rec = _record(srv, m.id)
    assert rec.api == "messages" and rec.user == "u-42" and rec.engine == "mock"
    assert m.usage.output_tokens == rec.completion_tokens == 8
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == rec.prompt_tokens
    assert m.usage.cache_read_input_tokens == rec.cached_tokens == 4
    # chat completions keep the default tag
    status, _, body = srv.chat({"model": "mock", "messages": HI, "max_tokens": 2})
    assert status == 200 and _record(srv, "msg_" + body["id"].removeprefix("chatcmpl-")).api == "chat"


def test_auto_routes_and_a_stop_sequence_is_reported(srv, client):
    m = client.messages.create(model="auto", max_tokens=40, messages=HI, stop_sequences=["fox"],
                               extra_body={"temperature": 0.5, "top_p": 0.9})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "fox"
    assert m.content[0].text.endswith("brown ") and _record(srv, m.id).route_reason != "pinned"
    m = client.messages.create(model="mock", max_tokens=200, messages=HI)
    assert m.stop_reason == "end_turn"


def test_stream_text_and_final_message_match_create(srv, client):
    whole = client.messages.create(model="mock", max_tokens=12, messages=HI)
    with client.messages.stream(model="mock", max_tokens=12, messages=HI) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    rec = _record(srv, final.id)
    assert rec.api == "messages" and rec.stream and final.usage.input_tokens + final.usage.cache_read_input_tokens \
        == rec.prompt_tokens


def test_raw_event_sequence(srv):
    status, headers, raw = srv.request("POST", "/v1/messages", {
        "model": "mock", "max_tokens": 3, "stream": True, "messages": HI}, headers={"x-api-key": KEY})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    names = []
    for block in raw.decode().strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        names.append(name)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_tool_use_round_trip(srv, client):
    m = client.messages.create(model="caller", max_tokens=400, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"}])
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "unit": "c"} and use.id.startswith("toolu_")
    convo = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]}]

    def answer(result: str) -> list:
        return convo + [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": result}]},
            {"type": "text", "text": "Thanks, and so?"}]}]

    reply = client.messages.create(model="mock", max_tokens=5, tools=[WEATHER], messages=answer("18 C, sunny"))
    assert reply.content[0].type == "text" and reply.stop_reason == "max_tokens"
    # The result reaches the prompt: a longer result is more input tokens.
    short = client.messages.count_tokens(model="mock", tools=[WEATHER], messages=answer("18 C")).input_tokens
    long = client.messages.count_tokens(model="mock", tools=[WEATHER],
                                        messages=answer("18 C, sunny, light wind from the west")).input_tokens
    assert long > short
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model="mock", tools=[WEATHER], messages=answer("18 C, sunny")).input_tokens


def test_streamed_tool_use_arrives_as_input_json_deltas(client):
    with client.messages.stream(model="caller", max_tokens=400, tools=[WEATHER], tool_choice={"type": "auto"},
                                messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "input_json_delta" in kinds
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris", "unit": "c"}


def test_tool_choice_none_leaves_the_call_as_text(client):
    m = client.messages.create(model="caller", max_tokens=400, tools=[WEATHER], tool_choice={"type": "none"},
                               messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == CALL and m.stop_reason == "end_turn"


def test_count_tokens_matches_the_billed_prompt(srv, client):
    counted = client.messages.count_tokens(model="mock", system="Be brief.", messages=HI).input_tokens
    m = client.messages.create(model="mock", max_tokens=2, system="Be brief.", messages=HI)
    assert counted == _record(srv, m.id).prompt_tokens > client.messages.count_tokens(model="mock",
                                                                                       messages=HI).input_tokens
    auto = client.messages.count_tokens(model="auto", system="Be brief.", messages=HI).input_tokens
    assert auto == counted     # both engines share a tokenizer
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=HI)


def test_x_api_key_and_bearer_both_authenticate(srv):
    bearer = anthropic.Anthropic(base_url=srv.base_url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model="mock", max_tokens=2, messages=HI).usage.output_tokens == 2
    status, _, body = srv.request("POST", "/v1/messages", {"model": "mock", "max_tokens": 2, "messages": HI},
                                  headers={"Authorization": "", "x-api-key": KEY})
    assert status == 200 and json.loads(body)["type"] == "message"


def test_bad_and_missing_keys_are_401_authentication_error(srv):
    bad = anthropic.Anthropic(base_url=srv.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="mock", max_tokens=2, messages=HI)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    status, _, body = srv.request("POST", "/v1/messages/count_tokens", {"model": "mock", "messages": HI},
                                  headers={"Authorization": ""})
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert "x-api-key" in json.loads(body)["error"]["message"]       # the header these routes' clients send


@pytest.mark.parametrize("body, field", [
    ({"model": "mock", "messages": HI}, "max_tokens"),
    ({"model": "mock", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "image"),
    ({"model": "mock", "max_tokens": 5, "messages": HI, "temperature": 1.5}, "temperature"),
    ({"model": "mock", "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ({"model": "mock", "max_tokens": 5, "messages": HI, "tools": [{"type": "web_search_20250305",
                                                                    "name": "web_search"}]}, "web_search"),
    ({"model": "mock", "max_tokens": 5, "messages": HI + [{"role": "assistant", "content": "Sure"}]}, "prefill"),
    ({"model": "mock", "max_tokens": 5, "messages": HI, "top_k": -1}, "top_k"),
    ({"model": "mock", "max_tokens": 5, "messages": HI, "frequency_penalty": 1}, "frequency_penalty"),
])
def test_refusals_are_400_in_anthropics_shape(srv, body, field):
    status, headers, raw = srv.request("POST", "/v1/messages", body)
    data = json.loads(raw)
    assert status == 400 and data["type"] == "error", data
    assert data["error"]["type"] == "invalid_request_error" and field in data["error"]["message"]
    assert headers["x-should-retry"] == "false"


def test_sdk_raises_bad_request_for_missing_max_tokens(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="mock", messages=HI, max_tokens=None)  # type: ignore[arg-type]
    assert e.value.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}


def test_unknown_model_and_method_in_anthropics_shape(srv, client):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-nope", max_tokens=2, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    status, _, raw = srv.request("GET", "/v1/messages")
    assert status == 405 and json.loads(raw)["type"] == "error"


def test_top_k_reaches_the_engine(srv, client):
    seen = []
    engine = srv.gateway.handles["mock"].engine
    original = engine.add_request

    def spy(request_id, prompt_ids, params, **kw):
        seen.append(params.top_k)
        return original(request_id, prompt_ids, params, **kw)

    engine.add_request = spy
    try:
        client.messages.create(model="mock", max_tokens=2, messages=HI, extra_body={"top_k": 7})
        client.messages.create(model="mock", max_tokens=2, messages=HI)
    finally:
        del engine.add_request
    assert seen == [7, 0]


def test_rate_limit_is_429_rate_limit_error_with_retry_after():
    prefix = unique_prefix("messages")
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        key, _ = KeyStore(client, prefix).create("slow", rpm=1, tpm=0)
        doc = {"server": {"access_log": False}, "redis_url": SHARED_REDIS, "redis_prefix": prefix,
               "rate_limits": {"window_s": 1.0},
               "engines": {"mock": {"type": "mock", "model": MODEL_DIR, "max_sleep_ms": 2}}}
        with running_gateway(doc) as srv:
            sdk = anthropic.Anthropic(base_url=srv.base_url, api_key=key, max_retries=0)
            sdk.messages.create(model="mock", max_tokens=2, messages=HI)
            with pytest.raises(anthropic.RateLimitError) as e:
                sdk.messages.create(model="mock", max_tokens=2, messages=HI)
            assert e.value.body["error"]["type"] == "rate_limit_error"
            assert e.value.response.headers["retry-after"] == "1" and int(e.value.response.headers["retry-after-ms"]) > 0
    finally:
        client.close()
        delete_prefix(SHARED_REDIS, prefix)


# -- the translation, without a server --------------------------------------------------------------
def test_translation_of_system_tool_use_and_tool_results():
    req = parse_messages_request({
        "model": "auto", "max_tokens": 50, "system": "Be brief.", "tools": [WEATHER],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "stop_sequences": ["\n\n"],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in ", "cache_control": {"type": "ephemeral"}},
                                         {"type": "text", "text": "Paris?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "timeout"}]},
                                         {"type": "text", "text": "So?"}]}]})
    assert req.api == "messages" and req.stop == ["\n\n"] and req.max_tokens == 50 and req.top_k == 0
    assert req.tools.choice == "auto" and not req.tools.parallel and req.tools.names() == {"get_weather"}
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: timeout", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "So?"}]


@pytest.mark.parametrize("choice, expected", [
    ({"type": "any"}, ("required", None)), ({"type": "tool", "name": "get_weather"}, ("function", "get_weather")),
    ({"type": "none"}, ("none", None))])
def test_tool_choice_translation(choice, expected):
    req = parse_messages_request({"model": "m", "max_tokens": 5, "messages": HI, "tools": [WEATHER],
                                  "tool_choice": choice})
    assert (req.tools.choice, req.tools.function) == expected


def test_unknown_tool_named_by_tool_choice_is_400():
    with pytest.raises(BadRequest, match="get_time"):
        parse_messages_request({"model": "m", "max_tokens": 5, "messages": HI, "tools": [WEATHER],
                                "tool_choice": {"type": "tool", "name": "get_time"}})


@pytest.mark.timeout(300)
def test_forced_tool_use_on_smollm2():
    """`any` and a named `tool` hold SmolLM2-135M's reply to one call (constrained decoding), streamed or not."""
    from tests.gateway.test_gguf_smollm2_gateway import _smollm2_engine
    tool = {"name": "get_weather", "description": "The current weather in a city", "input_schema": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": 30}}}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with running_gateway({"server": {"access_log": False}, "engines": {"smollm2-135m": _smollm2_engine()}}) as s:
        sdk = anthropic.Anthropic(base_url=s.base_url, api_key=KEY, max_retries=0, timeout=120)
        m = sdk.messages.create(model="smollm2-135m", max_tokens=60, tools=[tool], tool_choice={"type": "any"},
                                messages=ask, extra_body={"temperature": 0})
        with sdk.messages.stream(model="smollm2-135m", max_tokens=60, tools=[tool], messages=ask,
                                 tool_choice={"type": "tool", "name": "get_weather"}) as stream:
            final = stream.get_final_message()
    for reply in (m, final):
        assert reply.stop_reason == "tool_use"
        (use,) = reply.content
        assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
