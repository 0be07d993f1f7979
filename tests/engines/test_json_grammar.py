"""The grammars response_format schemas compile to (tokenyard.engines.core.json_grammar, schema_keywords): numbers,
arrays and objects bounded, strings without raw control characters and in forms xgrammar masks fast, every
keyword we accept enforced. Walks run over a small
vocabulary (single bytes, a few UTF-8 characters and multi-character tokens) so they take milliseconds."""
from __future__ import annotations

import json
import random
import re
from enum import Enum

import jsonschema
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

from tests.gateway.test_schema_keywords import Order as PydanticOrder
from tokenyard.engines.core.json_grammar import (
    DEFAULT_MAX_ITEMS,
    MAX_EXPONENT_DIGITS,
    MAX_FRACTION_DIGITS,
    MAX_INT_DIGITS,
    MAX_STRING_CHARS,
    json_schema_ebnf,
)
from tokenyard.engines.core.structured_output import Grammars

EOS = 0
TOKENS = ([b"</s>"] + [bytes([b]) for b in range(128)]
          + [c.encode() for c in "é€😀"] + [b'", "', b'": ', b"true", b"null", b"123", b".5", b"e+", b"\\u00", b'\\"'])


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(TOKENS, len(TOKENS), [EOS])


class _Doc:
    """Whether the grammar Grammars compiles for a schema takes a whole text (as one string)."""

    def __init__(self, grammars: Grammars, schema: dict) -> None:
        self.compiled = grammars.compile({"type": "json_schema", "schema": schema})

    def takes(self, text: str) -> bool:
        m = xgr.GrammarMatcher(self.compiled, terminate_without_stop_token=True)
        return m.accept_string(text) and m.is_completed()


def _allowed(constraint) -> list[int]:
    mask = torch.zeros(1, (len(TOKENS) + 31) // 32, dtype=torch.int32)
    constraint.fill_bitmask(mask, 0)
    return [t for t in range(len(TOKENS)) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


def walk(grammars: Grammars, schema: dict, rng: random.Random, wander: int, limit: int = 4000) -> bytes:
    """Random allowed tokens for `wander` steps, then close the document (EOS, quote, brackets, digits,
    short tokens first). Asserts the mask never allows a token the matcher refuses."""
    c = grammars.constraint({"type": "json_schema", "schema": schema})
    out = b""
    rank = {b'"': 0, b"@": 1, b"}": 2, b"]": 3}   # "@": an email's local part takes "}" forever
    for step in range(limit):
        allowed = _allowed(c)
        assert allowed, f"the grammar allows nothing after {out!r}"
        if step < wander:
            pick = rng.choice(allowed)
        else:
            pick = min(allowed, key=lambda t: (t != EOS, rank.get(TOKENS[t], 9), not TOKENS[t].isdigit(),
                                               TOKENS[t] == b",", len(TOKENS[t]), t))
        assert c.accept(pick)
        if pick == EOS:
            assert c.is_terminated
            return out
        out += TOKENS[pick]
    raise AssertionError(f"no end within {limit} tokens: {out[:200]!r}")


class City(BaseModel):          # issue 45: SmolLM2 wrote 1.0000000000000012111111... until max_tokens
    name: str
    population_millions: float


class Order(BaseModel):
    quantity: int = Field(ge=1, le=100)
    express: bool
    note: str = Field(max_length=12)


def test_numbers_have_bounded_digits(grammars):
    accepts = _Doc(grammars, City.model_json_schema()).takes
    doc = '{"name": "Paris", "population_millions": %s}'
    assert accepts(doc % ("1." + "0" * MAX_FRACTION_DIGITS)) and not accepts(doc % ("1." + "0" * (MAX_FRACTION_DIGITS + 1)))
    assert accepts(doc % ("9" * MAX_INT_DIGITS)) and not accepts(doc % ("9" * (MAX_INT_DIGITS + 1)))
    assert accepts(doc % ("-2.5e" + "9" * MAX_EXPONENT_DIGITS))
    assert not accepts(doc % ("2e" + "9" * (MAX_EXPONENT_DIGITS + 1)))
    ints = _Doc(grammars, {"type": "object", "properties": {"n": {"type": "integer"}, "m": {"type": "integer", "minimum": 1}},
                  "required": ["n", "m"]}).takes
    assert ints('{"n": -%s, "m": %s}' % ("9" * MAX_INT_DIGITS, "9" * MAX_INT_DIGITS))
    assert not ints('{"n": %s, "m": 1}' % ("9" * (MAX_INT_DIGITS + 1)))
    assert not ints('{"n": 1, "m": %s}' % ("9" * (MAX_INT_DIGITS + 1)))


def test_strings_never_hold_raw_control_characters(grammars):
    accepts = _Doc(grammars, City.model_json_schema()).takes
    doc = '{"name": "%s", "population_millions": 2}'
    # No maxLength: escapes allowed; at most MAX_STRING_CHARS characters, an escape counting as one.
    assert accepts(doc % 'a\\"b\\n\\u0041é😀')
    assert accepts(doc % ("x" * MAX_STRING_CHARS)) and not accepts(doc % ("x" * (MAX_STRING_CHARS + 1)))
    for ctl in ("\x00", "\x11", "\t", "\x1f", "\n"):
        assert not accepts(doc % ctl), repr(ctl)
    bounded = _Doc(grammars, Order.model_json_schema()).takes
    doc = '{"quantity": 5, "express": true, "note": "%s"}'
    # Issue 45.11: maxLength strings let U+0000-U+001F in raw (json.loads refuses them).
    for ctl in ("\x00", "\x11", "\t", "\x1f", "\n"):
        assert not bounded(doc % ctl), repr(ctl)
    assert bounded(doc % "aé😀") and not bounded(doc % 'a\\"b')    # a plain class: no escapes (as xgrammar's)
    assert bounded(doc % ("y" * 12)) and not bounded(doc % ("y" * 13))
    assert not bounded('{"quantity": 101, "express": true, "note": ""}')
    assert not bounded('{"quantity": 0, "express": true, "note": ""}')
    assert not bounded('{"quantity":5, "express": true, "note": ""}')  # whitespace is fixed


def test_a_string_without_max_length_holds_256_characters_escapes_counted(grammars):
    """Issue 45: past its first escape a string had no cap, so SmolLM2 repeated a team name after a `\\n` until
    max_tokens. Now 256 characters in all (docs/engine.md), an escape counting as one, a character as one
    whatever its UTF-8 length; property names of open objects too."""
    accepts = _Doc(grammars, City.model_json_schema()).takes
    doc = '{"name": "%s", "population_millions": 2}'
    for unit in ("x", "é", "😀", "\\n", '\\"', "\\u00e9", "\\\\"):
        assert accepts(doc % (unit * 256)) and not accepts(doc % (unit * 257)), unit
    assert accepts(doc % ("x" * 255 + "\\n")) and not accepts(doc % ("x" * 256 + "\\n"))
    assert accepts(doc % ("x" * 100 + "\\n" + "y" * 155)) and not accepts(doc % ("x" * 100 + "\\n" + "y" * 156))
    assert not accepts(doc % ("x" * 300 + "\\n" + "x" * 2000))
    any_json = grammars.compile({"type": "json_object"})
    for key, ok in (("k" * 256, True), ("k" * 257, False)):
        m = xgr.GrammarMatcher(any_json, terminate_without_stop_token=True)
        assert (m.accept_string('{"%s": "%s"}' % (key, "v" * 256)) and m.is_completed()) == ok


def test_a_string_that_loops_through_escapes_ends_at_the_cap(grammars):
    """A model that never closes a string, writing escapes (and characters) while the grammar allows them: after
    256 characters the mask leaves it only tokens that close the string."""
    c = grammars.constraint({"type": "json_schema", "schema": Team.model_json_schema()})
    opening = b'{"team": "'
    for b in opening:
        assert c.accept(TOKENS.index(bytes([b])))
    looping = [TOKENS.index(t) for t in (b'\\"', b"\\u00", b"x")]
    text, step = b"", 0
    while (pick := next((t for t in looping[step % 3:] + looping[:step % 3] if t in _allowed(c)), None)) is not None:
        step += 1                                          # an escaped quote, a \u escape, a character, in turn
        assert len(text) < 2000, text[-60:]                # no cap: it would loop to max_tokens
        assert c.accept(pick)
        text += TOKENS[pick]
        if TOKENS[pick] == b"\\u00":                     # two hex digits complete the escape
            for b in b"e9":
                assert c.accept(TOKENS.index(bytes([b])))
            text += b"e9"
    assert all(TOKENS[t].startswith(b'"') for t in _allowed(c)), [TOKENS[t] for t in _allowed(c)]
    assert len(json.loads(b'"' + text + b'"')) == 256 and b"\\u00e9" in text and b"x" in text


def test_lists_without_max_items_hold_16(grammars):
    """Issue 45: 32 members of a list of objects still filled 1,024 tokens; the default is 16 (docs/engine.md)."""
    palette = _Doc(grammars, Palette.model_json_schema()).takes
    doc = '{"colours": [%s]}'
    assert palette(doc % ", ".join(['"red"'] * 16)) and not palette(doc % ", ".join(['"red"'] * 17))
    open_map = _Doc(grammars, {"type": "object", "additionalProperties": {"type": "integer"}}).takes
    props = ", ".join(f'"k{i}": 1' for i in range(16))
    assert open_map("{" + props + "}") and not open_map("{" + props + ', "k16": 1}')


_REPEAT = re.compile(r"\b(\w+)\{(\d+), (-?\d+)\}")
_CLASS_BODY = re.compile(r'^\(\((\[(\\.|[^\]\\])*\]|"(\\.|[^"\\])")\)\)$')    # (([...])) or (("c")): one character


def test_no_unbounded_repeat_survives_and_bounded_repeats_are_masked_fast():
    """Digits, items and properties are bounded. And a bounded repeat is only ever of a character class or of a
    list continuation (or one literal character, in xgrammar's number ranges): a0873a5's
    `json_bounded_char{0, 512}` (a character-or-escape alternation, repeated) cost xgrammar 150 ms-1.8 s a mask
    on SmolLM2's vocabulary, on every engine step (tokenyard/bench/grammar_string_mask.py)."""
    schemas = [City.model_json_schema(), Order.model_json_schema(), {"type": "object"}, Palette.model_json_schema(),
               Team.model_json_schema(), PydanticOrder.model_json_schema(), *SCHEMAS.values(),
               {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}, "s": {"type": "string", "minLength": 2},
                                                 "a": {"type": "array", "items": {"type": "number"}}},
                "required": ["x", "s", "a"], "additionalProperties": {"type": "integer"}}]
    repeats = 0
    for schema in schemas:
        ebnf = json_schema_ebnf(xgr, json.dumps(schema), strict_mode=schema != {"type": "object"})
        bodies = dict(line.split(" ::= ", 1) for line in ebnf.splitlines())
        for name, body in bodies.items():
            line = f"{name} ::= {body}"
            body = body.split("(=")[0]                          # a lookahead consumes nothing
            assert "[0-9]*" not in body, line
            for m in _REPEAT.finditer(body):
                repeats += 1
                inner = bodies[m.group(1)]
                assert _CLASS_BODY.match(inner) or inner.startswith('((", " '), (line, inner)
                # unbounded: only a minLength string's characters (a class: as fast as the recursive rule)
                assert m.group(3) != "-1" or "\\x1f" in inner, line     # item and property counts (issue 45)
    assert repeats > 20
    slow = 'ch ::= (([^\\0-\\x1f\\"\\\\]) | ("\\\\" esc))'
    assert not _CLASS_BODY.match(slow.split(" ::= ")[1])       # the check would catch the slow form


SCHEMAS = {   # one or more of every keyword schema_keywords.ENFORCED lists
    "pydantic_order": PydanticOrder.model_json_schema(),   # nested lists, Optional, discriminated union, tuple
    "pydantic": {"$defs": {"Colour": {"enum": ["red", "green"], "type": "string"}},
                 "properties": {"c": {"$ref": "#/$defs/Colour"}, "o": {"anyOf": [{"type": "integer"}, {"type": "null"}],
                                                                      "default": None},
                                "l": {"const": "x", "type": "string"}},
                 "required": ["c", "l"], "type": "object", "title": "M"},
    "numbers": {"type": "object", "properties": {
        "a": {"type": "number", "exclusiveMinimum": 0, "maximum": 2.5}, "b": {"type": "integer", "minimum": -3,
                                                                               "exclusiveMaximum": 7},
        "m": {"type": "integer", "multipleOf": 7, "minimum": -30, "maximum": 100}, "f": {"type": "number"}},
        "required": ["a", "b", "m", "f"], "additionalProperties": False},
    "strings": {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "d": {"type": "string", "format": "date"},
        "e": {"type": "string", "format": "email"}, "n": {"type": "string", "minLength": 2, "maxLength": 5}},
        "required": ["p", "d", "e", "n"]},
    "arrays": {"type": "object", "properties": {
        "t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False,
              "minItems": 2, "maxItems": 2},
        "l": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 3,
              "uniqueItems": False}}, "required": ["t", "l"]},
    "objects": {"type": "object", "properties": {
        "m": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
        "p": {"type": "object", "patternProperties": {"^k": {"type": "boolean"}}},
        "n": {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,4}$"}, "additionalProperties": {"type": "null"},
              "minProperties": 1}}, "required": ["m", "p", "n"], "additionalProperties": False},
    "unions": {"definitions": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                               "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}, "n": {"type": "integer"}},
                                       "required": ["kind", "n"]}},
               "type": "object", "properties": {
                   "pet": {"oneOf": [{"$ref": "#/definitions/Cat"}, {"$ref": "#/definitions/Dog"}],
                           "discriminator": {"propertyName": "kind"}},
                   "v": {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "boolean"}]},
                   "w": {"allOf": [{"type": "integer", "maximum": 3, "minimum": 0}]},
                   "z": {"type": ["integer", "null"], "minimum": 3, "maximum": 5}},
               "required": ["pet", "v", "w", "z"]},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_walks_over_every_enforced_keyword_validate(grammars, name):
    rng = random.Random(name)
    for i in range(20):
        text = walk(grammars, SCHEMAS[name], rng, wander=rng.randrange(0, 120))
        doc = json.loads(text.decode())
        jsonschema.validate(doc, SCHEMAS[name])


def test_random_walks_through_long_strings_and_numbers_end(grammars):
    """Pure random walks (no closing strategy) end: numbers within their bounds, strings when a quote is drawn."""
    rng = random.Random(45)
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "x": {"type": "number"}},
              "required": ["s", "x"], "additionalProperties": False}
    for _ in range(20):
        text = walk(grammars, schema, rng, wander=10_000, limit=1084)
        jsonschema.validate(json.loads(text.decode()), schema)


class Colour(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Palette(BaseModel):       # issue 45: SmolLM2 listed colours until max_tokens
    colours: list[Colour]


class Member(BaseModel):
    name: str
    role: str


class Team(BaseModel):          # and members, in some list-of-objects replies
    team: str
    members: list[Member]


def loop(grammars: Grammars, fmt: dict, limit: int = 4000) -> bytes:
    """A model that loops: another item or property (", ") whenever the grammar allows one, the shortest
    way to the next such point otherwise, a close bracket only when nothing else is allowed."""
    c = grammars.constraint(fmt)
    rank = {b'", "': 1, b'"': 2, b'": ': 3, b"}": 9, b"]": 9}
    out = b""
    for _ in range(limit):
        pick = min(_allowed(c), key=lambda t: (t != EOS, rank.get(TOKENS[t], 5), t))
        assert c.accept(pick)
        if pick == EOS:
            return out
        out += TOKENS[pick]
    raise AssertionError(f"no end within {limit} tokens: {out[:200]!r}...{out[-100:]!r}")


def test_a_looping_list_ends_at_the_default_item_cap(grammars):
    """Issue 45: arrays without maxItems were unbounded, so a model that keeps adding items ran to max_tokens."""
    for model, key in ((Palette, "colours"), (Team, "members")):
        schema = model.model_json_schema()
        doc = json.loads(loop(grammars, {"type": "json_schema", "schema": schema}))
        jsonschema.validate(doc, schema)
        assert len(doc[key]) == DEFAULT_MAX_ITEMS, model.__name__
    pairs = json.loads(loop(grammars, {"type": "json_object"}), object_pairs_hook=list)   # an open object's
    assert len(pairs) == DEFAULT_MAX_ITEMS                                                # properties too


def test_item_and_property_caps_respect_the_schema(grammars):
    n = DEFAULT_MAX_ITEMS
    palette = _Doc(grammars, Palette.model_json_schema()).takes
    doc = '{"colours": [%s]}'
    assert palette(doc % ", ".join(['"red"'] * n)) and not palette(doc % ", ".join(['"red"'] * (n + 1)))
    assert palette(doc % "")

    def ints(k: int) -> str:
        return "[" + ", ".join(["1"] * k) + "]"

    at_least = _Doc(grammars, {"type": "array", "items": {"type": "integer"}, "minItems": n + 8}).takes
    assert at_least(ints(n + 8)) and not at_least(ints(n + 9)) and not at_least(ints(n + 7))
    explicit = _Doc(grammars, {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3 * n}).takes
    assert explicit(ints(3 * n)) and not explicit(ints(3 * n + 1)) and not explicit(ints(1))
    few = _Doc(grammars, {"type": "array", "items": {"type": "integer"}, "maxItems": 3}).takes
    assert few(ints(3)) and not few(ints(4))
    nested = _Doc(grammars, {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}).takes
    assert nested("[" + ", ".join([ints(n)] * n) + "]")
    assert not nested("[" + ", ".join([ints(n)] * (n + 1)) + "]") and not nested("[" + ints(n + 1) + "]")
    # prefixItems: the cap counts the items past the tuple
    tuple_then = _Doc(grammars, {"type": "array", "prefixItems": [{"type": "string"}, {"type": "string"}],
                                 "items": {"type": "integer"}}).takes
    assert tuple_then('["a", "b", ' + ints(n)[1:]) and not tuple_then('["a", "b", ' + ints(n + 1)[1:])
    # open objects: properties past the named ones; an explicit maxProperties is the schema's
    named = _Doc(grammars, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                            "additionalProperties": {"type": "integer"}}).takes

    def props(k: int, first: str = "") -> str:
        return "{" + ", ".join(([first] if first else []) + [f'"k{i}": 1' for i in range(k)]) + "}"

    assert named(props(n, '"a": 0')) and not named(props(n + 1, '"a": 0'))
    open_map = _Doc(grammars, {"type": "object", "additionalProperties": {"type": "integer"}}).takes
    assert open_map(props(n)) and not open_map(props(n + 1)) and open_map("{}")
    wide = _Doc(grammars, {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2 * n}).takes
    assert wide(props(2 * n)) and not wide(props(2 * n + 1))
    any_json = grammars.compile({"type": "json_object"})
    for text, ok in ((props(n), True), (props(n + 1), False), ('{"a": ' + ints(n) + "}", True),
                     ('{"a": ' + ints(n + 1) + "}", False)):
        m = xgr.GrammarMatcher(any_json, terminate_without_stop_token=True)
        assert (m.accept_string(text) and m.is_completed()) == ok, text[:40]
