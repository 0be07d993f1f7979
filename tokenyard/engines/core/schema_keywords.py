"""Which JSON Schema keywords a response_format grammar enforces; the rest are refused, never ignored.

xgrammar (0.2.9) drops what it cannot compile with at most a log line: `not`, `contains`, `uniqueItems`,
`if`/`then`/`else`, `dependent*`, multi-schema `allOf`, `multipleOf` beside a range or over 1024,
`maxLength` beside a `pattern`, a `type` beside `enum` or `anyOf`, a `$ref`'s siblings, numeric and
string bounds in a schema without a `type`. A request with such a schema would end with "stop" and a
document that fails its own schema. So `check_schema` walks the schema first (no library, cheap) and
raises GrammarError naming the first keyword it cannot honour and where it is (a JSON Pointer, "#" is
the schema's root); `rewrite_schema` then turns the one keyword we enforce ourselves (integer multipleOf
inside a range) into what the library enforces (an enum of the multiples).

Enforced (ENFORCED): type, enum, const, properties, required, additionalProperties, patternProperties,
propertyNames, minProperties, maxProperties, items (a schema), prefixItems, minItems, maxItems,
minLength, maxLength, pattern, format (date, time, date-time, duration, email, hostname, ipv4, ipv6,
uri, uri-reference, uri-template, uuid, json-pointer, relative-json-pointer; another format is an
annotation, as jsonschema treats it), minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf
(integers, between a minimum and a maximum holding at most MAX_MULTIPLES multiples), anyOf, oneOf
(branches that cannot both match: distinct types, or a required property with distinct const values),
allOf (one schema), $ref (local, "#..."), $defs, definitions, uniqueItems: false.
Annotations (ANNOTATIONS, and keys starting "x-"): accepted, they constrain nothing.
Anything else is refused (REFUSED lists the JSON Schema assertions among them).
"""
from __future__ import annotations

import math
from typing import Any

from tokenyard.engines.core.errors import RequestError

MAX_MULTIPLES = 256     # integer multipleOf becomes an enum of this many values at most
MAX_DEPTH = 64          # nested schemas; deeper is refused (and would exhaust the walker's stack)

ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema", "$id", "contentEncoding", "contentMediaType", "discriminator"})
ENFORCED = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
                      "propertyNames", "minProperties", "maxProperties", "items", "prefixItems", "minItems",
                      "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
                      "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf", "oneOf", "allOf", "$ref",
                      "$defs", "definitions", "uniqueItems"})
REFUSED = frozenset({"not", "contains", "minContains", "maxContains", "if", "then", "else", "dependentRequired",
                     "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
                     "additionalItems", "contentSchema", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                     "$recursiveAnchor", "$anchor", "$vocabulary"})

_KIND_KEYWORDS = {   # keywords that only mean something for one JSON type: the schema must name that type
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("patternProperties", "propertyNames", "minProperties", "maxProperties"),
}
_ALONE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")   # the library ignores their siblings
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "null": (type(None),), "array": (list,), "object": (dict,)}


class SchemaError(RequestError):
    """A schema keyword the grammar cannot enforce (structured_output re-raises it as a GrammarError)."""


_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength", "maxLength",
            "minItems", "maxItems", "minProperties", "maxProperties")
_NAME_LISTS = ("required",)


def check_schema(schema: Any) -> None:
    """Raise SchemaError for the first keyword the grammar would not enforce (see the module doc)."""
    _check(schema, "#", schema, 0)


def _check_values(node: dict, path: str) -> None:
    """Keyword values of the wrong kind are the client's error (400), never an exception deeper down:
    json.loads reads 1e400 as inf and accepts NaN, which the range arithmetic cannot take."""
    for key in _NUMERIC:
        if key in node:
            v = node[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise _refuse(path, key, f"must be a finite number, got {v!r:.40}")
    for key in _NAME_LISTS:
        if key in node and not (isinstance(node[key], list) and all(isinstance(n, str) for n in node[key])):
            raise _refuse(path, key, "must be an array of property names")


def _refuse(path: str, keyword: str, why: str) -> SchemaError:
    return SchemaError(f"response_format schema: '{keyword}' at {path} {why}")


def _check(node: Any, path: str, root: Any, depth: int, names: bool = False) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise SchemaError(f"response_format schema: {path} must be a schema (an object or a boolean)")
    if depth > MAX_DEPTH:
        raise SchemaError(f"response_format schema: {path} nests deeper than {MAX_DEPTH} schemas")
    for key in node:
        if key in ANNOTATIONS or key in ENFORCED or key.startswith("x-"):
            continue
        why = "is not enforced by the grammar" if key in REFUSED else "is not a keyword the grammar knows"
        raise _refuse(path, key, why + " (refused rather than ignored)")
    _check_values(node, path)
    types = _types(node, path) or ({"string"} if names else set())   # property names are strings
    _check_siblings(node, path, types)
    if "multipleOf" in node:
        _multiples(node, path, types)
    if node.get("uniqueItems", False) is not False:
        raise _refuse(path, "uniqueItems", "is not enforced by the grammar (refused rather than ignored)")
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        raise _refuse(path, "maxLength" if "maxLength" in node else "minLength",
                      "beside 'pattern' or 'format' is not enforced; put the length in the pattern, e.g. {1,20}")
    items = node.get("items")
    if isinstance(items, list):
        raise _refuse(path, "items", "as an array (draft-07 tuples) is not supported; use prefixItems")
    ref = node.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        raise _refuse(path, "$ref", f"must point inside the schema ('#/...'), got {ref!r}")
    if "oneOf" in node:
        _one_of(node["oneOf"], path, root)
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) != 1:
        raise _refuse(path, "allOf", "is enforced with one schema only; merge them into one")
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        for name, sub in _mapping(node, key, path).items():
            _check(sub, f"{path}/{key}/{_escape(name)}", root, depth + 1)
    for key in ("additionalProperties", "items", "propertyNames"):
        if key in node:
            _check(node[key], f"{path}/{key}", root, depth + 1, names=key == "propertyNames")
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise SchemaError(f"response_format schema: {path}/{key} must be a non-empty array of schemas")
            for i, sub in enumerate(node[key]):
                _check(sub, f"{path}/{key}/{i}", root, depth + 1)


def _types(node: dict, path: str) -> set[str]:
    kind = node.get("type")
    kinds = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    if kind is not None and (kinds is None or not all(isinstance(k, str) and k in _JSON_TYPES for k in kinds)):
        raise _refuse(path, "type", f"must be one of {', '.join(_JSON_TYPES)} or a list of them, got {kind!r}")
    return set(kinds or ())


def _check_siblings(node: dict, path: str, types: set[str]) -> None:
    for alone in _ALONE:
        if alone in node:
            others = [k for k in node if k not in ANNOTATIONS and k not in ("$defs", "definitions", alone)
                      and not k.startswith("x-") and not (alone in ("enum", "const") and k == "type")]
            if others:
                raise _refuse(path, others[0], f"beside '{alone}' is not enforced (the grammar follows '{alone}' "
                                               f"alone); move it into the {alone} schema(s)")
    if types and ("enum" in node or "const" in node):
        values = node["enum"] if "enum" in node else [node["const"]]
        for v in values if isinstance(values, list) else []:
            if not any(_is_type(v, t) for t in types):
                raise _refuse(path, "enum" if "enum" in node else "const", f"value {v!r} is not of type {node['type']}")
    if "$ref" in node or "enum" in node or "const" in node or "anyOf" in node or "oneOf" in node or "allOf" in node:
        return
    for kind, keywords in _KIND_KEYWORDS.items():
        wanted = {"number", "integer"} if kind == "number" else {kind}
        for key in keywords:
            if key in node and not types & wanted:
                raise _refuse(path, key, f"needs a 'type' of {' or '.join(sorted(wanted))} beside it "
                                         "(without one the grammar ignores it)")


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return isinstance(value, _JSON_TYPES[kind])


def _multiples(node: dict, path: str, types: set[str]) -> None:
    step = node["multipleOf"]
    if types != {"integer"} or not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise _refuse(path, "multipleOf", "is enforced only for {'type': 'integer'} with a positive integer step")
    low, high = _range(node)
    if low is None or high is None:
        raise _refuse(path, "multipleOf", "needs a minimum and a maximum beside it (the grammar lists the multiples)")
    count = max(0, high // step - (low + step - 1) // step + 1)
    if count > MAX_MULTIPLES:
        raise _refuse(path, "multipleOf", f"allows {count} values in its range; at most {MAX_MULTIPLES} are enforced")
    if count == 0:
        raise _refuse(path, "multipleOf", "leaves no value in [minimum, maximum]")


def _range(node: dict) -> tuple[int | None, int | None]:
    """The inclusive integer range of an integer schema's bounds (None where unbounded)."""
    low = high = None
    for key, inclusive_low in (("minimum", True), ("exclusiveMinimum", False)):
        if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool):
            v = math.ceil(node[key]) if inclusive_low else math.floor(node[key]) + 1
            low = v if low is None else max(low, v)
    for key, inclusive_high in (("maximum", True), ("exclusiveMaximum", False)):
        if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool):
            v = math.floor(node[key]) if inclusive_high else math.ceil(node[key]) - 1
            high = v if high is None else min(high, v)
    return low, high


def rewrite_schema(node: Any) -> Any:
    """A copy of a checked schema with integer multipleOf (and its range) turned into an enum."""
    if isinstance(node, list):
        return [rewrite_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: rewrite_schema(v) if k not in ("enum", "const", "default", "examples") else v for k, v in node.items()}
    if "multipleOf" in out:
        low, high = _range(out)
        step = out.pop("multipleOf")
        assert low is not None and high is not None     # check_schema refused the rest
        first = -(-low // step) * step
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            out.pop(key, None)
        out["enum"] = list(range(first, high + 1, step))
    return out


def _one_of(branches: Any, path: str, root: Any) -> None:
    """oneOf compiles as anyOf: accept it only where no document can match two branches."""
    if not isinstance(branches, list):
        return
    resolved = [_resolve(b, root) for b in branches]
    kinds = [_types(b, path) if isinstance(b, dict) else set() for b in resolved]
    if all(kinds) and _disjoint([{"number"} | k if "integer" in k else
                                  {"integer"} | k if "number" in k else k for k in kinds]):
        return
    if all(isinstance(b, dict) for b in resolved):
        for prop in set.intersection(*(_required(b) for b in resolved)):
            tags = [_tags(b.get("properties", {}).get(prop), root) for b in resolved]
            known = [t for t in tags if t is not None]
            if len(known) == len(tags) and _disjoint(known):
                return
    raise _refuse(path, "oneOf", "is enforced only when no document can match two branches (distinct types, or a "
                                 "required property with distinct const values); use anyOf")


def _required(node: dict) -> set[str]:
    """A branch's required names; a malformed list is refused when the branch itself is checked."""
    names = node.get("required", [])
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _tags(prop: Any, root: Any) -> set[str] | None:
    prop = _resolve(prop, root)
    if not isinstance(prop, dict):
        return None
    if "const" in prop:
        return {repr(prop["const"])}
    if isinstance(prop.get("enum"), list):
        return {repr(v) for v in prop["enum"]}
    return None


def _disjoint(sets: list[set]) -> bool:
    seen: set = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True


def _resolve(node: Any, root: Any, hops: int = 0) -> Any:
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or hops > MAX_DEPTH:
        return node
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        target = target.get(part) if isinstance(target, dict) else None
    return _resolve(target, root, hops + 1) if target is not None else node


def _mapping(node: dict, key: str, path: str) -> dict:
    value = node.get(key, {})
    if not isinstance(value, dict):
        raise SchemaError(f"response_format schema: {path}/{key} must be an object of schemas")
    return value


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
