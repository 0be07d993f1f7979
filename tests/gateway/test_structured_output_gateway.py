"""response_format through the product: the default deployment's smollm2-135m engine behind a
gateway, driven by the openai SDK (parse() with a pydantic model, json_object, json_schema), and
the 400s for schemas the engine cannot honour."""
from __future__ import annotations

import json
from enum import Enum

import jsonschema
import openai
import pytest
from gateway_helpers import KEY, running_gateway
from pydantic import BaseModel, Field

from tests.engines.test_structured_output import SCHEMAS
from tests.gateway.test_gguf_smollm2_gateway import _smollm2_engine
from tokenyard.engines.core.structured_output import MAX_SCHEMA_CHARS


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)
    colours: list[Colour] = Field(max_length=3)


@pytest.fixture(scope="module")
def srv():
    doc = {"server": {"access_log": False}, "engines": {"smollm2-135m": _smollm2_engine()}}
    with running_gateway(doc) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.mark.timeout(300)
def test_sdk_parse_returns_a_parsed_pydantic_object(client):
    r = client.chat.completions.parse(model="smollm2-135m", messages=ASK, response_format=City, temperature=0,
                                      max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    city = choice.message.parsed
    assert isinstance(city, City) and 0 <= city.population_millions <= 50, city


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_generations_validate(client, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    r = client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=fmt, temperature=0.7,
                                       seed=11, max_tokens=150)
    assert r.choices[0].finish_reason == "stop", r
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])


# json_object bounds nothing but the syntax, and greedy SmolLM2 asked to describe Paris can repeat a key until
# max_tokens: on AVX-512 machines, once their int4 products took int8 inputs as AVX2 ones do, it did. So a
# question with a short answer, and a frequency penalty against repeated keys (passes with the AVX2, AVX-512
# and AVX-512 VNNI builds of the C step)
ASK_SHORT = [{"role": "user", "content": "Give the capital of France as a JSON object with one key."}]


def test_json_object_streams_an_object(client):
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=ASK_SHORT, response_format={"type": "json_object"}, temperature=0,
        max_tokens=120, frequency_penalty=1.0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"], text
    assert isinstance(json.loads(text), dict), text


def test_cut_by_max_tokens_is_length_not_valid_json(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS["person"]}}
    r = client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=fmt, temperature=0,
                                       max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "response_format",
     "'type' at #"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format", "parenthesis"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "description": "d" * MAX_SCHEMA_CHARS}}}, "response_format", "limit"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "response_format.json_schema.name",
     "name"),
    ({"type": "json_schema"}, "response_format.json_schema", "json_schema"),
    ({"type": "xml"}, "response_format.type", "xml"),
    ({"type": "json_object", "schema": {}}, "response_format.schema", "schema"),
])
def test_bad_response_format_is_400_naming_the_problem(client, fmt, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format=fmt, max_tokens=4)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_text_format_is_plain_text(client):
    r = client.chat.completions.create(model="smollm2-135m", messages=ASK, response_format={"type": "text"},
                                       temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason == "length"


class IssueCity(BaseModel):     # issue 45: an unbounded float ran to max_tokens as 1.0000000000000012111111...
    name: str
    country: str
    population_millions: float


class IssueOrder(BaseModel):    # issue 45: a bounded int, a bool and a string also ran to the limit
    item: str
    quantity: int = Field(ge=1, le=100)
    express: bool


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, prompt", [(IssueCity, "Describe Paris."), (IssueCity, "Describe Tokyo."),
                                           (IssueOrder, "Two pizzas, express please.")])
def test_sdk_parse_of_ordinary_models_ends_well_before_max_tokens(client, model, prompt):
    """The small version of tokenyard/bench/structured_parse_bench.py: numbers and strings are bounded in the grammar,
    so greedy SmolLM2 finishes with a valid document in few tokens instead of looping to max_tokens."""
    messages = [{"role": "system", "content": "Reply with JSON only."}, {"role": "user", "content": prompt}]
    r = client.chat.completions.parse(model="smollm2-135m", messages=messages, response_format=model,
                                      temperature=0, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, model), choice
    assert r.usage.completion_tokens < 150, (r.usage.completion_tokens, choice.message.content)
