"""Tool calls and n > 1 through the product: the default deployment's smollm2-135m engine behind a
gateway, driven by the openai SDK; n on the mock engine for the bill and the refund."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from gateway_helpers import KEY, mock_deployment, running_gateway
from pydantic import BaseModel, Field

from tests.gateway.test_gguf_smollm2_gateway import _smollm2_engine

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                   "properties": {"zone": {"type": "string", "maxLength": 20}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Booking(BaseModel):
    """Book a table at a restaurant."""

    restaurant: str = Field(max_length=30)
    people: int = Field(ge=1, le=12)


@pytest.fixture(scope="module")
def srv():
    records = []
    doc = {"server": {"access_log": False}, "engines": {MODEL: _smollm2_engine()}}
    with running_gateway(doc, usage_sink=records.append) as s:
        s.records = records
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _valid_call(call, tools):
    tool = next(t for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


@pytest.mark.timeout(300)
def test_named_function_is_called_with_arguments_that_follow_its_schema(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid_call(call, [WEATHER])


@pytest.mark.timeout(300)
def test_required_calls_one_of_the_tools_at_any_temperature(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required",
                                       temperature=1.0, seed=3, n=3, max_tokens=60)
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        _valid_call(choice.message.tool_calls[0], [WEATHER, CLOCK])


@pytest.mark.timeout(300)
def test_streamed_tool_call_deltas_reassemble_in_the_sdk(client):
    tool = openai.pydantic_function_tool(Booking)
    with client.chat.completions.stream(model=MODEL, tools=[tool], tool_choice="required", temperature=0,
                                        messages=[{"role": "user", "content": "Book Chez Paul for four people."}],
                                        max_tokens=60) as stream:
        pieces = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    assert len(pieces) > 2   # the arguments arrived in pieces
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    booking = choice.message.tool_calls[0].function.parsed_arguments
    assert isinstance(booking, Booking) and 1 <= booking.people <= 12


@pytest.mark.timeout(300)
def test_a_conversation_with_a_tool_result_is_answered(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.timeout(300)
def test_the_round_trip_with_auto_tools_ends_in_a_plain_answer(client):
    # Issue 45.6: the tool result went back as a <tool_response> turn and the model echoed it as its
    # answer. SmolLM2 now gets its own format, and the result in plain words (tokenyard/gateway/prompt/tool_prompt.py).
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "18 degrees and sunny"}]
    for stream in (False, True):
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                model=MODEL, messages=messages, tools=[WEATHER, CLOCK], temperature=0, max_tokens=40, stream=True)
                if c.choices)
        else:
            r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK],
                                               temperature=0, max_tokens=40)
            assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
            text = r.choices[0].message.content
        assert text and text.strip(), text
        for markup in ("<tool_response>", "</tool_response>", "<tool_call>", "<tools>", "<|im_start|>", "<|im_end|>"):
            assert markup not in text, text


@pytest.mark.timeout(300)
def test_n_choices_prefill_once_and_differ(srv, client):
    engine = srv.app.state.gateway.handles[MODEL].engine
    before = engine.stats().prefix_cache_hit_tokens
    messages = [{"role": "user", "content": "Write two lines about the sea and the moon, in a new way."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=16, temperature=1.0, seed=11)
    hits = engine.stats().prefix_cache_hit_tokens - before
    block = engine.stats().block_size
    prompt = r.usage.prompt_tokens
    # Choices 1..3 found the prompt's full blocks that choice 0 computed; only its partial block is redone.
    # (Choice 0 may itself have found the default system prompt's first block, cached by an earlier test.)
    leader = r.usage.prompt_tokens_details.cached_tokens
    assert hits == 3 * ((prompt - 1) // block * block) + leader, (hits, prompt, block, leader)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, texts    # each choice its own seed
    assert 4 <= r.usage.completion_tokens <= 4 * 16
    # The same request again, now with its prompt cached: the same choices. Choice 0 used to differ
    # (CI, 2026-12-03; issue 45.4): the first time it prefilled the prompt in one chunk, the second time
    # only the partial block after the cached ones, which rounds differently; and choices 1..3 joined
    # when choice 0's first token reached the gateway, a step later or two as the event loop was busy.
    # Now a seeded prefill computes that block apart either way, and the engine holds choices 1..3
    # until choice 0's first token (tokenyard/engines/core/scheduler.py), whenever they arrive.
    again = client.chat.completions.create(model=MODEL, messages=messages, n=4, max_tokens=16, temperature=1.0, seed=11)
    assert [c.message.content for c in again.choices] == texts
    record = srv.records[-1]
    assert record.prompt_tokens == prompt and record.completion_tokens == again.usage.completion_tokens
    # n = 1 is reproducible: on an idle engine the same request runs the same steps. (The first
    # request above prefilled the whole prompt; these two both recompute only its partial block.)
    one = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=1.0,
                                          seed=11).choices[0].message.content for _ in range(2)]
    assert one[0] == one[1], one


@pytest.mark.timeout(300)
def test_n_choices_stream_with_their_index(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=8, temperature=1.0, seed=5,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        text[c.index] += c.delta.content or ""
        if c.finish_reason:
            finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and usage.completion_tokens <= 16 and all(text.values())
    full = client.chat.completions.create(model=MODEL, messages=ASK, n=2, max_tokens=8, temperature=1.0, seed=5)
    assert [c.message.content for c in full.choices] == [text[0], text[1]]


def test_forced_tools_and_response_format_together_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"


def test_a_tool_schema_the_grammar_cannot_compile_is_400_naming_tools(client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[bad], tool_choice="required")
    assert e.value.body["param"] == "tools", e.value.body


def test_n_on_the_mock_engine_bills_the_prompt_once_and_refunds_once():
    records, ends, reserved = [], [], []
    with running_gateway(mock_deployment(), usage_sink=records.append) as srv:
        gatekeeper = srv.gateway.gatekeeper
        enter = gatekeeper.enter

        class Spy:     # the admission pass, with its end() recorded
            def __init__(self, inner):
                self.inner, self.headers = inner, inner.headers

            def end(self, used):
                ends.append(used)
                self.inner.end(used)

            def billing(self, sink):   # the budget hold's settling sink, unchanged
                return self.inner.billing(sink)

        async def spying_enter(key, engine, prompt_tokens, max_tokens, *args):
            reserved.append((prompt_tokens, max_tokens))
            return Spy(await enter(key, engine, prompt_tokens, max_tokens, *args))

        gatekeeper.enter = spying_enter
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        r = client.chat.completions.create(model="mock", messages=ASK, n=3, max_tokens=4)
        assert len(r.choices) == 3 and r.usage.completion_tokens == 12
        assert len(records) == 1 and records[0].completion_tokens == 12
        assert records[0].prompt_tokens == r.usage.prompt_tokens
        # Reserved: the prompt once and max_tokens for each choice; given back: what was used, once.
        assert reserved == [(r.usage.prompt_tokens, 12)] and ends == [r.usage.prompt_tokens + 12]
        r = client.completions.create(model="mock", prompt="Once upon a time", n=2, max_tokens=3)
        assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 6
        assert len(records) == 2 and ends[-1] == r.usage.prompt_tokens + 6
        # A batch of prompts: n choices each, indexed prompt * n + choice; every prompt counted once.
        prompts = ["Once upon a time", [1, 2, 3, 4, 5]]
        r = client.completions.create(model="mock", prompt=prompts, n=2, max_tokens=3)
        tok = srv.gateway.handles["mock"].tokenizer
        prompt_tokens = len(tok.encode(prompts[0])) + 5
        assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 12
        assert r.usage.prompt_tokens == prompt_tokens and records[-1].prompt_tokens == prompt_tokens
        assert reserved[-1] == (prompt_tokens, 12) and ends[-1] == prompt_tokens + 12
        stream = client.completions.create(model="mock", prompt=prompts, max_tokens=3, stream=True)
        finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason}
        assert finished == {0: "length", 1: "length"}
