"""POST /v1/responses (OpenAI's Responses API) through the product, driven by the openai SDK: text, instructions
and input items, the typed stream, the function-call round trip, stored responses (GET, DELETE,
previous_response_id, another tenant's id a 404, in memory and in Redis), the 400s for what Tokenyard cannot
honour, usage and the spend record's `api`; a Batch API line for /v1/responses; structured output with
`responses.parse` on the demo torch engine."""
from __future__ import annotations

import json
import time

import openai
import pytest
import redis
from batch_helpers import batch_document, client, jsonl, read_lines, tenant_key, wait_batch
from gateway_helpers import KEY, ROOT, SHARED_REDIS, add_key, delete_prefix, running_gateway, unique_prefix
from pydantic import BaseModel, Field

from tokenyard.engines.serving.mock_engine import DEFAULT_REPLY

MODEL_DIR = str(ROOT / "models" / "demo-small")
CALL_REPLY = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def srv():
    records: list = []
    doc = {"server": {"access_log": False}, "engines": {
        "mock": {"type": "mock", "model": MODEL_DIR},
        "mock-tools": {"type": "mock", "model": MODEL_DIR, "reply": CALL_REPLY}}}
    with running_gateway(doc, usage_sink=records.append) as s:
        s.records = records
        yield s


@pytest.fixture(scope="module")
def sdk(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _record(srv, before: int):
    """The one usage record written since `before` records."""
    deadline = time.monotonic() + 5
    while len(srv.records) <= before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(srv.records) == before + 1, srv.records[before:]
    return srv.records[-1]


def test_text_input_gives_a_response_object_with_usage_and_an_api_tagged_record(srv, sdk):
    before = len(srv.records)
    r = sdk.responses.create(model="mock", input="Hello there", instructions="Answer briefly.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.model == "mock" and r.output_text == DEFAULT_REPLY
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    rec = _record(srv, before)
    assert rec.api == "responses" and rec.engine == "mock"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (rec.prompt_tokens, rec.completion_tokens)
    assert r.usage.total_tokens == rec.prompt_tokens + rec.completion_tokens
    assert r.usage.input_tokens_details.cached_tokens == rec.cached_tokens
    # The same words as chat: the instructions are a system message, the input a user message.
    before = len(srv.records)
    chat = sdk.chat.completions.create(model="mock", messages=[{"role": "system", "content": "Answer briefly."},
                                                               {"role": "user", "content": "Hello there"}])
    assert chat.usage.prompt_tokens == r.usage.input_tokens
    assert _record(srv, before).api == "chat"


def test_input_items_and_max_output_tokens(srv, sdk):
    items = [{"role": "system", "content": "Be terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                             {"type": "input_text", "text": "again"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "And now?"}]
    r = sdk.responses.create(model="mock", input=items, max_output_tokens=5, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    short = sdk.responses.create(model="mock", input="Hi", store=False)
    # Four messages cost more prompt tokens than one.
    assert r.usage.input_tokens > short.usage.input_tokens


def test_auto_routing_serves_responses(srv, sdk):
    r = sdk.responses.create(model="auto", input="Hi", store=False)
    assert r.model in ("mock", "mock-tools") and r.status == "completed"


def test_stream_events_in_order_with_sequence_numbers(srv, sdk):
    before = len(srv.records)
    with sdk.responses.stream(model="mock", input="Hi", instructions="Say hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == DEFAULT_REPLY == final.output_text
    rec = _record(srv, before)
    assert rec.api == "responses" and rec.stream
    assert final.usage.output_tokens == rec.completion_tokens and final.status == "completed"
    # The stored copy is the streamed one.
    assert sdk.responses.retrieve(final.id).output_text == DEFAULT_REPLY


def test_create_stream_true_raw_events(srv):
    status, headers, raw = srv.request("POST", "/v1/responses", {"model": "mock", "input": "Hi", "stream": True,
                                                                  "store": False})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.decode().split("\n\n") if b]
    assert all(b.startswith("event: ") for b in blocks)
    first = blocks[0].split("\n")
    assert first[0] == "event: response.created" and json.loads(first[1][len("data: "):])["sequence_number"] == 0
    assert blocks[-1].startswith("event: response.completed")


def test_function_call_round_trip(srv, sdk):
    r = sdk.responses.create(model="mock-tools", input="Weather in Paris?", tools=[WEATHER])
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and r.status == "completed"
    # The next turn sends the call and its output back as input items (the SDK's documented pattern).
    before = len(srv.records)
    follow = sdk.responses.create(model="mock", tools=[WEATHER], store=False, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert follow.output_text == DEFAULT_REPLY
    longer = _record(srv, before).prompt_tokens
    # ... and the same through previous_response_id: only the output is new input.
    cont = sdk.responses.create(model="mock", tools=[WEATHER], previous_response_id=r.id, store=False, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert cont.usage.input_tokens == longer


def test_streamed_function_call_arguments_events(srv, sdk):
    with sdk.responses.stream(model="mock-tools", input="Weather?", tools=[WEATHER], store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    assert final.output[0].type == "function_call" and final.output[0].arguments == done.arguments


def test_stored_response_get_delete_and_previous_response_id(srv, sdk):
    first = sdk.responses.create(model="mock", input="Remember the number 7.", instructions="Be kind.")
    got = sdk.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    second = sdk.responses.create(model="mock", input="Which number?", previous_response_id=first.id)
    alone = sdk.responses.create(model="mock", input="Which number?", store=False)
    # The stored turn (its input and output) comes before the new input; instructions are not carried over.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        sdk.responses.create(model="mock", input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(first.id)
    # store: false keeps nothing.
    unstored = sdk.responses.create(model="mock", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


def test_another_tenants_response_is_a_404(srv, sdk):
    mine = sdk.responses.create(model="mock", input="secret")
    other = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=add_key(srv, "tenant-b"), max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="mock", input="x", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert sdk.responses.retrieve(mine.id).id == mine.id      # still there for its owner


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1, "environment": "linux"}]},
     "tools[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": None}, "input"),
    ({"tools": [{"type": "function", "name": "bad name!", "parameters": {}}]}, "tools[0].name"),
])
def test_what_tokenyard_cannot_honour_is_a_400_naming_the_field(srv, sdk, extra, param):
    before = len(srv.records)
    body = {"model": "mock", "input": "hi", **extra}
    status, _, raw = srv.request("POST", "/v1/responses", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert len(srv.records) == before       # refused before any engine work or bill


def test_unknown_response_id_and_auth(srv):
    status, _, raw = srv.request("GET", "/v1/responses/resp_nope")
    assert status == 404 and json.loads(raw)["error"]["code"] == "response_not_found"
    status, _, _ = srv.request("GET", "/v1/responses/resp_nope", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, _, _ = srv.request("POST", "/v1/responses", {"model": "mock", "input": "x"},
                               headers={"Authorization": "Bearer wrong"})
    assert status == 401


# -- Redis: stored per tenant with the deployment's retention; a Batch API line -------------------------------
@pytest.fixture(scope="module")
def redis_srv(tmp_path_factory):
    prefix = unique_prefix("responses")
    doc = batch_document(prefix, str(tmp_path_factory.mktemp("batch")))
    doc["responses"] = {"retention_days": 2}
    try:
        with running_gateway(doc) as s:
            s.prefix = prefix
            yield s
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_redis_store_is_per_tenant_with_the_retention(redis_srv):
    a = client(redis_srv, tenant_key(redis_srv.prefix, "ta"))
    b = client(redis_srv, tenant_key(redis_srv.prefix, "tb"))
    r = a.responses.create(model="mock", input="hello")
    conn = redis.Redis.from_url(SHARED_REDIS)
    try:
        key = f"{redis_srv.prefix}resp:ta:{r.id}"
        ttl = conn.ttl(key)
        assert 2 * 86400 - 60 < ttl <= 2 * 86400
    finally:
        conn.close()
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(r.id)
    follow = a.responses.create(model="mock", input="more", previous_response_id=r.id)
    assert follow.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)


def test_batch_line_for_v1_responses(redis_srv):
    c = client(redis_srv)
    line = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/responses",
                       "body": {"model": "mock", "input": "hi", "instructions": "be brief"}})
    f = c.files.create(file=("r.jsonl", jsonl([line])), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h").id)
    assert done.request_counts.completed == 1, done
    (out,) = read_lines(c, done.output_file_id)
    body = out["response"]["body"]
    assert out["response"]["status_code"] == 200 and body["object"] == "response"
    assert body["output"][0]["content"][0]["text"] == DEFAULT_REPLY and body["usage"]["output_tokens"] > 0
    assert c.responses.retrieve(body["id"]).id == body["id"]     # stored like an HTTP request's


def test_deployment_retention_is_checked():
    from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
    doc = {"engines": {"mock": {"type": "mock", "model": MODEL_DIR}}}
    assert parse_deployment(doc, base_dir=ROOT).responses.retention_s == 30 * 86400
    for bad in (0, -1, "ten", True):
        with pytest.raises(DeploymentError, match="responses.retention_days"):
            parse_deployment({**doc, "responses": {"retention_days": bad}}, base_dir=ROOT)
    with pytest.raises(DeploymentError, match="responses.nope"):
        parse_deployment({**doc, "responses": {"nope": 1}}, base_dir=ROOT)


# -- structured output (text.format json_schema) on the demo torch engine --------------------------------------
class Pet(BaseModel):
    name: str = Field(max_length=10)   # bounded, so the grammar closes the JSON within max_output_tokens
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def torch_srv():
    doc = {"server": {"access_log": False}, "engines": {"demo-small": {"type": "torch", "model": MODEL_DIR}}}
    with running_gateway(doc) as s:
        yield s


@pytest.mark.timeout(300)
def test_responses_parse_with_a_pydantic_model(torch_srv):
    sdk = openai.OpenAI(base_url=torch_srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = sdk.responses.parse(model="demo-small", input="A pet as JSON", text_format=Pet, max_output_tokens=200,
                            temperature=0, store=False)
    assert r.status == "completed", r
    assert isinstance(r.output_parsed, Pet) and 0 <= r.output_parsed.legs <= 8


# -- an upstream engine (type: openai): its chat reply translated, whole and streamed ---------------------------
@pytest.fixture(scope="module")
def upstream_pair():
    mp = pytest.MonkeyPatch()
    mp.setenv("TY_TEST_UPSTREAM_KEY", KEY)      # the upstream gateway's dev key
    records: list = []
    up_doc = {"server": {"access_log": False}, "engines": {
        "m": {"type": "mock", "model": MODEL_DIR}, "mt": {"type": "mock", "model": MODEL_DIR, "reply": CALL_REPLY}}}
    try:
        with running_gateway(up_doc) as up:
            front_doc = {"server": {"access_log": False}, "engines": {
                name: {"type": "openai", "base_urls": [up.base_url + "/v1"], "upstream_model": model,
                       "api_key_env": "TY_TEST_UPSTREAM_KEY"} for name, model in (("big", "m"), ("big-tools", "mt"))}}
            with running_gateway(front_doc, usage_sink=records.append) as front:
                front.records = records
                yield front, openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    finally:
        mp.undo()


def test_upstream_engine_reply_as_a_response(upstream_pair):
    front, sdk = upstream_pair
    before = len(front.records)
    r = sdk.responses.create(model="big", input="hello", instructions="be brief")
    assert r.model == "big" and r.output_text == DEFAULT_REPLY and r.status == "completed"
    rec = _record(front, before)
    assert rec.api == "responses" and (rec.prompt_tokens, rec.completion_tokens) == (r.usage.input_tokens,
                                                                                     r.usage.output_tokens)
    assert sdk.responses.retrieve(r.id).output_text == DEFAULT_REPLY
    with sdk.responses.stream(model="big", input="hello", previous_response_id=r.id) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == DEFAULT_REPLY and final.usage.input_tokens > r.usage.input_tokens


def test_upstream_function_call_streamed(upstream_pair):
    _, sdk = upstream_pair
    r = sdk.responses.create(model="big-tools", input="Weather?", tools=[WEATHER], store=False)
    assert r.output[0].type == "function_call" and json.loads(r.output[0].arguments) == {"city": "Paris"}
    with sdk.responses.stream(model="big-tools", input="Weather?", tools=[WEATHER], store=False) as stream:
        list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
