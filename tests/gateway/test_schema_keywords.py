"""Schema keywords the grammar cannot enforce are refused (issue 46.6), naming the keyword and where it is,
before any compilation: in the engine's check and as an OpenAI-style 400 at the gateway (mock engine)."""
from __future__ import annotations

import json
import re
from enum import Enum
from typing import Literal, Optional, Union

import pytest
from gateway_helpers import mock_deployment, running_gateway
from pydantic import BaseModel, Field

from tokenyard.engines.core.schema_keywords import ANNOTATIONS, ENFORCED, REFUSED, SchemaError, check_schema, rewrite_schema
from tokenyard.engines.core.structured_output import GrammarError, check_response_format

INT = {"type": "integer"}


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": sorted(props)}


# (schema, keyword named, path named): each was dropped by xgrammar 0.2.9 and ended "stop" with a document
# that fails the schema
REFUSALS = [
    (_obj(x={"type": "integer", "multipleOf": 2000, "minimum": 0, "maximum": 10**6}), "multipleOf", "#/properties/x"),
    (_obj(x={"type": "number", "multipleOf": 0.5}), "multipleOf", "#/properties/x"),
    (_obj(x={"type": "integer", "multipleOf": 3}), "multipleOf", "#/properties/x"),      # no range: unbounded digits
    (_obj(x={"type": "integer", "not": {"const": 3}}), "not", "#/properties/x"),
    (_obj(x={"type": "array", "items": INT, "contains": {"const": 3}}), "contains", "#/properties/x"),
    ({"allOf": [INT, {"type": "string"}]}, "allOf", "at # "),
    ({"oneOf": [INT, {"type": "number"}]}, "oneOf", "at # "),                              # 1 matches both
    (_obj(x={"type": "array", "items": INT, "uniqueItems": True}), "uniqueItems", "#/properties/x"),
    (_obj(x={"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}), "maxLength", "#/properties/x"),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 3}]}, "type", "at # "),
    ({"$defs": {"A": INT}, "$ref": "#/$defs/A", "maximum": 3}, "maximum", "at # "),
    ({"type": "string", "enum": ["a", 1]}, "enum", "at # "),
    ({"minimum": 3}, "minimum", "at # "),
    ({"$ref": "https://example.com/s.json"}, "$ref", "at # "),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if", "at # "),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "at # "),
    ({"type": "integer", "nullable": True}, "nullable", "at # "),                          # not JSON Schema
    ({"$defs": {"A/B": {"type": "array", "items": [INT]}}}, "items", "#/$defs/A~1B"),
    ({"type": "foo"}, "type", "at # "),
]


@pytest.mark.parametrize("schema, keyword, where", REFUSALS)
def test_a_keyword_the_grammar_would_drop_is_refused_with_its_path(schema, keyword, where):
    with pytest.raises(GrammarError) as e:
        check_response_format({"type": "json_schema", "schema": schema})
    assert f"'{keyword}'" in str(e.value) and where in str(e.value), str(e.value)


def test_every_keyword_is_in_exactly_one_list():
    assert not (ANNOTATIONS & ENFORCED) and not (ANNOTATIONS & REFUSED) and not (ENFORCED & REFUSED)
    for keyword in REFUSED:
        with pytest.raises(SchemaError, match=re.escape(f"'{keyword}'")):
            check_schema({"type": "object", keyword: {}})


class Colour(str, Enum):
    red = "red"
    blue = "blue"


class Item(BaseModel):
    sku: str = Field(max_length=8, description="stock unit", examples=["A1"])
    quantity: int = Field(ge=1, le=100)
    colours: list[Colour] = Field(max_length=3)


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Order(BaseModel):
    items: list[Item]
    note: Optional[str] = None
    weight: float = Field(gt=0)
    pet: Union[Cat, Dog] = Field(discriminator="kind")
    point: tuple[int, str]
    step: int = Field(multiple_of=5, ge=0, le=50)


def test_the_schemas_pydantic_emits_pass():
    check_response_format({"type": "json_schema", "schema": Order.model_json_schema()})
    check_response_format({"type": "json_schema", "schema": True})
    check_response_format({"type": "json_object"})


def test_integer_multiple_of_in_a_range_becomes_the_list_of_multiples():
    schema = {"type": "object", "properties": {"s": {"type": "integer", "multipleOf": 5, "exclusiveMinimum": -7,
                                                     "maximum": 12, "title": "S"}}}
    check_schema(schema)
    assert rewrite_schema(schema)["properties"]["s"] == {"type": "integer", "title": "S", "enum": [-5, 0, 5, 10]}
    with pytest.raises(SchemaError, match="multipleOf"):
        check_schema({"type": "integer", "multipleOf": 1, "minimum": 0, "maximum": 10**6})


def test_depth_is_capped():
    schema: dict = INT
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    with pytest.raises(SchemaError, match="deeper"):
        check_schema(schema)


@pytest.fixture(scope="module")
def gw():
    with running_gateway(mock_deployment()) as g:
        yield g


@pytest.mark.parametrize("schema, keyword, where", REFUSALS[:6])
def test_the_gateway_answers_400_naming_keyword_and_path(gw, schema, keyword, where):
    status, _, body = gw.chat({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                               "response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": schema}}})
    assert status == 400, body
    err = body["error"]
    assert err["param"] == "response_format" and err["type"] == "invalid_request_error", err
    assert f"'{keyword}'" in err["message"] and where in err["message"], err


# Keyword values json.loads accepts but range arithmetic cannot take (1e400 reads as inf, NaN), and a
# `required` that is not a list of names: each was an exception past the 400 path (a 500) before.
BAD_VALUES = [
    ({"type": "integer", "multipleOf": 1, "minimum": 0, "maximum": float("inf")}, "maximum"),
    ({"type": "integer", "multipleOf": 1, "minimum": float("nan"), "maximum": 5}, "minimum"),
    ({"type": "string", "maxLength": "12"}, "maxLength"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": [["a"]]}, "required"),
    # oneOf compares its branches' required names before each branch is checked: refused, never a TypeError
    ({"oneOf": [{"type": "object", "required": [["a"]]}, {"type": "object", "required": ["a"]}]}, "oneOf"),
]


@pytest.mark.parametrize("schema, keyword", BAD_VALUES)
def test_keyword_values_of_the_wrong_kind_are_refused(schema, keyword):
    with pytest.raises(SchemaError, match=re.escape(f"'{keyword}'")):
        check_schema(schema)


def test_the_gateway_answers_400_for_an_infinite_bound(gw):
    raw = ('{"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": '
           '{"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "multipleOf": 1, '
           '"minimum": 0, "maximum": 1e400}}}}')
    status, _, data = gw.request("POST", "/v1/chat/completions", raw, {"content-type": "application/json"})
    body = json.loads(data)
    assert status == 400, body
    assert body["error"]["param"] == "response_format" and "'maximum'" in body["error"]["message"], body
