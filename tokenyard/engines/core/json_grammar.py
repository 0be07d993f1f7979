"""The grammar a JSON Schema is generated under: xgrammar's conversion, numbers, arrays and objects bounded.

xgrammar (0.2.9) turns a schema into EBNF, then we rewrite that EBNF before compiling it, because its
conversion leaves a small model's favourite loops open and lets invalid JSON through:
- numbers: integer digits, fraction digits and exponent digits were unbounded (`[0-9]*`, `digits{1, -1}`):
  SmolLM2 wrote `1.0000000000000012111111...` until max_tokens. Now an integer part has at most
  MAX_INT_DIGITS digits, a fraction at most MAX_FRACTION_DIGITS, an exponent at most MAX_EXPONENT_DIGITS.
  (A schema's minimum/maximum are xgrammar's own: it builds exact digit ranges, fractions to 6 digits.)
- strings without minLength/maxLength: at most MAX_STRING_CHARS characters in all, an escape (\\n, \\", \\u00e9)
  counting as one (a surrogate pair's two \\u escapes as two). Before, only the run up to the first escape was
  capped (512) and xgrammar's recursive rule followed, uncapped: SmolLM2 looped past a `\\n` until max_tokens.
  Written as a chain of MAX_STRING_CHARS + 1 rules, json_string_<n> ("the closing quote, or a character or an
  escape then json_string_<n-1>"), xgrammar's own recursive rule counted down: masked in 0.01-0.04 ms on
  SmolLM2's vocabulary at every position (tokenyard/bench/grammar_string_mask.py). A bounded repeat (`{0, n}`)
  is not: xgrammar 0.2.9 unrolls n <= 128 into a chain of nested optional rules and, past 128, keeps the last
  128 unrolled; near the end of an unrolled part, tokens that would cross it are checked one by one (1.5 ms
  at 116 characters into the old 512 run; 5-9 ms near the end of a `{0, 64}` run after an escape), and a
  repeat of "character or escape" took 150 ms-1.8 s (a0873a5). A schema that wants longer strings says so
  with maxLength.
- strings with minLength/maxLength: xgrammar's character class `[^"\\\r\n]` let raw control characters
  (U+0000-U+001F but CR, LF) in, which json.loads rejects. Now a plain class: any character but a control
  character, a quote or a backslash, so no escapes in them (xgrammar refused escapes there too): a character
  class repeat is masked as fast as the recursive rule, an alternation with an escape is not.
  minLength without maxLength: no upper bound but max_tokens (the class repeat `{n, -1}`, left as xgrammar
  writes it).
- arrays and open objects: without maxItems an array's items were unbounded (`items{0, -1}`): SmolLM2 kept
  adding colours to a `list[Colour]` and members to a list of objects until max_tokens. Now an array
  without maxItems holds at most DEFAULT_MAX_ITEMS items (past its prefixItems tuple, if any), and an
  object without maxProperties at most DEFAULT_MAX_ITEMS properties (past the ones its schema names, if
  it also allows others: additionalProperties, patternProperties, json_object). An explicit maxItems /
  maxProperties is the schema's own (xgrammar's count, larger or smaller); a minItems / minProperties above
  the default is kept (exactly that many then).
- whitespace: none (any_whitespace=False): ", " and ": " between items, nothing else.
`pattern` strings are the pattern's regex (bound its repeats yourself, e.g. [a-z]{1,20}). Nesting depth is
the schema's, except where it allows any JSON value (json_object, `{}`, an array or object without
items/additionalProperties schemas) and the recursion of a self-referencing `$ref`: there max_tokens ends it.

The rewrite is on xgrammar's printed EBNF, so it is pinned to its shapes: tests/engines/test_json_grammar.py
checks that no unbounded repeat (digits, items, properties) survives for the schema kinds pydantic emits,
and that no bounded repeat is of anything but a character class or a list continuation (the slow form).
"""
from __future__ import annotations

import re
from typing import Any

MAX_INT_DIGITS = 15        # 999,999,999,999,999 < 2**53: every such integer is exact as a double
MAX_FRACTION_DIGITS = 15   # a double carries 15-17 significant digits; more is the model looping
MAX_EXPONENT_DIGITS = 2    # 1e99 is finite; 1e999 parses as inf
# Items of an array without maxItems, properties of an open object without maxProperties. 16: SmolLM2 at
# temperature 0.8 filled a 32-member list of objects (names of 30-300 characters) to 1,024 tokens, where the
# lists it means to write (colours, crew members, contacts) hold a handful; a schema that wants longer lists
# says so with maxItems (pydantic: Field(max_length=...)).
DEFAULT_MAX_ITEMS = 16

# A minLength/maxLength string's character: anything but a control character, '"' or '\'. A plain character
# class, never an alternation with an escape: xgrammar 0.2.9 fills the mask of a bounded repeat of such an
# alternation in 150 ms at a string's start and 1.8 s at 100+ characters (0.015 ms for this class;
# tokenyard/bench/grammar_string_mask.py), on the engine's step, for the whole batch.
_LENGTH_CHAR = '(([^\\0-\\x1f\\"\\\\]))'
# A string without minLength/maxLength holds at most this many characters (an escape counting as one). 256 ends
# SmolLM2's string loops ("Meadad_Meadad_...", a street of comma-separated numbers, a name repeated past a
# `\n`) well inside the 1,024 max_tokens clients commonly send; names, titles and sentences fit.
MAX_STRING_CHARS = 256
_STRING_BODY = '(("\\"" basic_string_sub))'
_STRING_LEFT = "json_string_"      # json_string_<n>: the rest of a string that may hold n more characters
_LOOKAHEAD = re.compile(r"\(=\(.*\)\)$")
_RULE = re.compile(r"^(\w+) ::= (.*)$")
_DIGIT_BODY = "(([0-9]))"
_LENGTH_CHAR_BODY = '(([^\\"\\\\\\r\\n]))'                    # xgrammar's minLength/maxLength character
_UNBOUNDED = re.compile(r"(\[eE\] \w+ |\[1-9\] )?\b(\w+)\{(\d+), -1\}")
_CONTINUATION = '((", " '        # a rule that adds one more item or property: (", " item) or (", " key ": " value)
# What precedes a continuation's repeat when the list's first element is written beside it ('"[" first R{..}'
# or '"{" key ": " value R{..}'): then the repeat counts all items but one. Elsewhere (after a prefixItems
# tuple, after named properties) it counts the items past those.
_AFTER_FIRST = re.compile(r'"[\[{]" (\w+ ": " )?\w+ $')


def json_schema_ebnf(xgr: Any, schema_text: str, *, strict_mode: bool = True) -> str:
    """EBNF of the schema (compact JSON, no free whitespace), numbers, arrays and objects bounded."""
    grammar = xgr.Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=strict_mode)
    return bound_ebnf(str(grammar))


def bound_ebnf(ebnf: str) -> str:
    """Rewrite xgrammar's converted EBNF (one rule a line) so numbers, arrays and objects are bounded, strings
    free of raw control characters."""
    rules: list[tuple[str, str]] = []
    for line in ebnf.splitlines():
        m = _RULE.match(line)
        if m is None:
            if line.strip():
                raise ValueError(f"unexpected EBNF line from the JSON Schema converter: {line[:80]!r}")
            continue
        rules.append((m.group(1), m.group(2)))
    digits = {name for name, body in rules if body == _DIGIT_BODY}
    length_chars = {name for name, body in rules if body == _LENGTH_CHAR_BODY}
    continuations = {name for name, body in rules if body.startswith(_CONTINUATION)}
    out = []
    bodies = dict(rules)
    for name, body in rules:
        if body == _STRING_BODY and "basic_escape" in bodies:
            body = f'(("\\"" {_STRING_LEFT}{MAX_STRING_CHARS}))'
        elif name in length_chars:
            body = _LENGTH_CHAR
        elif not body.startswith("Regex("):   # a pattern's regex is the user's
            body = body.replace("[0-9]*", f"[0-9]{{0, {MAX_INT_DIGITS - 1}}}")
            body = _UNBOUNDED.sub(lambda m: _bounded(m, digits, length_chars, continuations), body)
        out.append(f"{name} ::= {body}")
    if any(body == _STRING_BODY for _, body in rules) and "basic_escape" in bodies:
        out.extend(_string_chain(bodies.get("basic_string_sub", "")))
    return "\n".join(out) + "\n"


def _bounded(m: re.Match, digits: set[str], length_chars: set[str], continuations: set[str]) -> str:
    before, name, low = m.group(1) or "", m.group(2), int(m.group(3))
    if name in digits:   # after "[eE] sign": an exponent; after "[1-9] ": an integer part; else a fraction
        cap = (MAX_EXPONENT_DIGITS if before.startswith("[eE]") else
               MAX_INT_DIGITS - 1 if before else MAX_FRACTION_DIGITS)
    elif name in continuations:   # items / properties; the low count is the schema's minItems - 1 (or 0)
        cap = DEFAULT_MAX_ITEMS - 1 if _AFTER_FIRST.search(m.string, 0, m.start()) else DEFAULT_MAX_ITEMS
    else:
        return m.group(0)        # no other open repeat is known; the tests check none survives
    return f"{before}{name}{{{low}, {max(low, cap)}}}"


def _string_chain(string_sub: str) -> list[str]:
    """json_string_<n> for n = MAX_STRING_CHARS..0: the closing quote, or (while n > 0) a character or an escape
    and then json_string_<n-1>. Each rule keeps the lookahead of xgrammar's recursive rule (what may follow a
    string), which lets the mask cache settle the tokens that cross a string's end."""
    look = _LOOKAHEAD.search(string_sub)
    tail = f" {look.group(0)}" if look else ""
    char = _LENGTH_CHAR[2:-2]
    rules = [f'{_STRING_LEFT}{n} ::= (("\\"") | ({char} {_STRING_LEFT}{n - 1}) | '
             f'("\\\\" basic_escape {_STRING_LEFT}{n - 1})){tail}' for n in range(MAX_STRING_CHARS, 0, -1)]
    return [*rules, f'{_STRING_LEFT}0 ::= (("\\""))' + tail]
