"""Ten JSON schemas for structured-output checks: nested objects, enums, arrays with bounds,
numbers with bounds, booleans, nullable fields, anyOf. Strings and arrays are bounded so a
constrained generation closes well within a couple of hundred tokens.

Used by tokenyard/bench/structured_outputs_bench.py (500 generations) and tests/test_structured_output*.py.
"""
from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": _NAME,
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": _NAME, "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON,
    "enum_only": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"], "additionalProperties": False},
    "bounded_array": {"type": "object", "properties": {
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                   "minItems": 1, "maxItems": 4},
        "ok": {"type": "boolean"}}, "required": ["scores", "ok"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {"outer": {"type": "object", "properties": {
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["x"], "additionalProperties": False}},
        "required": ["inner"], "additionalProperties": False}}, "required": ["outer"], "additionalProperties": False},
    "city": {"type": "object", "properties": {
        "name": _NAME, "country": _NAME,
        "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
        "capital": {"type": "boolean"}}, "required": ["name", "country", "population_millions", "capital"],
        "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": _NAME, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]},
        "online": {"type": "boolean"}}, "required": ["title", "day", "month", "online"],
        "additionalProperties": False},
    "nullable": {"type": "object", "properties": {
        "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["note", "count"], "additionalProperties": False},
    "shape": {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0,
                                                                          "maximum": 10}},
         "required": ["kind", "r"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                                             "maximum": 10}},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "number", "minimum": -1, "maximum": 1}}}},
        "required": ["rows"], "additionalProperties": False},
}

PROMPTS = {
    "person": "Describe a person as JSON.",
    "enum_only": "Pick a colour and answer as JSON.",
    "bounded_array": "Give a few small scores as JSON.",
    "nested": "Answer with a nested JSON object.",
    "city": "Describe a city as JSON.",
    "order": "Write a shop order as JSON.",
    "event": "Describe an upcoming event as JSON.",
    "nullable": "Write a counter with an optional note as JSON.",
    "shape": "Describe a shape as JSON.",
    "matrix": "Write a small matrix as JSON.",
}
