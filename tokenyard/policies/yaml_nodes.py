"""Typed reading of composed YAML nodes, collecting problems with their line, column and key path.

Validation works on yaml.compose's node tree, not on yaml.safe_load's Python objects, because
nodes keep (a) their position in the text, for errors an operator can jump to, and (b) the
scalar's source text, so a price written 0.05 is read as the decimal "0.05" (never through a
float) and a time written 22:00 is not turned into YAML 1.1's sexagesimal integer 1320.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .cost import parse_money
from .errors import Problem

_T = "tag:yaml.org,2002:"
INT, FLOAT, BOOL, NULL, STR = _T + "int", _T + "float", _T + "bool", _T + "null", _T + "str"
_INT_TEXT = re.compile(r"^[-+]?[0-9]+$")       # plain decimal only: no 0x, 0o, 1_000 or 1:30
_FLOAT_TEXT = re.compile(r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?$")
_TRUE = {"true", "True", "TRUE"}
_FALSE = {"false", "False", "FALSE"}
V = TypeVar("V")


def all_read(values: Mapping[str, V | None]) -> dict[str, V] | None:
    """The values when every one was read, None when any was refused (the Reader has already
    recorded why): one read per key, then one check, so every bad key is reported at once."""
    read = {k: v for k, v in values.items() if v is not None}
    return read if len(read) == len(values) else None


def all_read_items(values: Sequence[V | None]) -> tuple[V, ...] | None:
    """all_read for a list: the items when every one was read, else None."""
    read = tuple(v for v in values if v is not None)
    return read if len(read) == len(values) else None


def describe(node: Node) -> str:
    """How a wrong value reads in an error message."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == NULL:
        return "null"
    text = node.value if len(node.value) <= 40 else node.value[:37] + "..."
    return repr(text)


class Reader:
    """Reads nodes into Python values; every failure becomes a Problem and returns None so the
    caller carries on and more problems are found in one pass."""

    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def problem(self, node: Node | None, path: str, message: str, allowed: Sequence[str] = ()) -> None:
        line = column = None
        mark = getattr(node, "start_mark", None) if node is not None else None
        if mark is not None:
            line, column = mark.line + 1, mark.column + 1
        self.problems.append(Problem(path, message, line, column, tuple(allowed)))

    @staticmethod
    def is_null(node: Node | None) -> bool:
        return node is None or (isinstance(node, ScalarNode) and node.tag == NULL)

    def mapping(self, node: Node, path: str, allowed: Sequence[str] | None = None,
                required: Sequence[str] = ()) -> dict[str, Node] | None:
        """A mapping with string keys; unknown keys (when `allowed` is given), duplicate keys and
        missing required keys are problems. Returns key -> value node in document order."""
        if not isinstance(node, MappingNode):
            self.problem(node, path, f"must be a mapping, got {describe(node)}")
            return None
        out: dict[str, Node] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == NULL:
                self.problem(key_node, path, f"keys must be strings, got {describe(key_node)}")
                continue
            key = key_node.value
            sub = f"{path}.{key}" if path else key
            if key in out:
                self.problem(key_node, sub, "duplicate key")
                continue
            if allowed is not None and key not in allowed:
                self.problem(key_node, sub, "unknown key", allowed)
                continue
            out[key] = value_node
        for key in required:
            if key not in out:
                self.problem(node, f"{path}.{key}" if path else key, "missing required key")
        return out

    def sequence(self, node: Node, path: str) -> list[Node] | None:
        if not isinstance(node, SequenceNode):
            self.problem(node, path, f"must be a list, got {describe(node)}")
            return None
        return list(node.value)

    def _scalar_text(self, node: Node, path: str, what: str) -> str | None:
        if not isinstance(node, ScalarNode) or node.tag == NULL:
            self.problem(node, path, f"must be {what}, got {describe(node)}")
            return None
        return node.value

    def string(self, node: Node, path: str, allowed: Sequence[str] = (), pattern: re.Pattern | None = None,
               what: str = "a string") -> str | None:
        """A string; any scalar's text is accepted (a tenant named 123 is the string "123"),
        except booleans, which are nearly always a YAML slip (no, off)."""
        text = self._scalar_text(node, path, what)
        if text is None:
            return None
        if node.tag == BOOL and not node.style:
            self.problem(node, path, f"must be {what}, got the boolean {text!r} (quote it)", allowed)
            return None
        if allowed and text not in allowed:
            self.problem(node, path, f"must be one of the allowed values, got {text!r}", allowed)
            return None
        if pattern is not None and not pattern.match(text):
            self.problem(node, path, f"must be {what}, got {text!r}")
            return None
        return text

    def strings(self, node: Node, path: str, pattern: re.Pattern | None = None,
                what: str = "a string", allowed: Sequence[str] = ()) -> tuple[str, ...] | None:
        """A string or a list of strings (a single value is a one-element list); never empty."""
        if isinstance(node, SequenceNode):
            items = [self.string(n, f"{path}[{i}]", allowed, pattern, what) for i, n in enumerate(node.value)]
            if not items:
                self.problem(node, path, "must not be an empty list")
                return None
            return all_read_items(items)
        one = self.string(node, path, allowed, pattern, what)
        return None if one is None else (one,)

    def integer(self, node: Node, path: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
        text = self._scalar_text(node, path, "an integer")
        if text is None:
            return None
        if node.style or not _INT_TEXT.match(text.strip()):
            self.problem(node, path, f"must be an integer, got {describe(node)}")
            return None
        value = int(text)
        return self._bounded(node, path, value, minimum, maximum)

    def number(self, node: Node, path: str, minimum: float | None = None, maximum: float | None = None,
               exclusive: bool = False) -> float | None:
        """A plain number (not money: thresholds and shares, which are probabilities)."""
        text = self._scalar_text(node, path, "a number")
        if text is None:
            return None
        if node.style or not _FLOAT_TEXT.match(text.strip()):
            self.problem(node, path, f"must be a number, got {describe(node)}")
            return None
        value = float(text)
        low_bad = minimum is not None and (value <= minimum if exclusive else value < minimum)
        high_bad = maximum is not None and (value >= maximum if exclusive else value > maximum)
        if low_bad or high_bad:
            brackets = "()" if exclusive else "[]"
            self.problem(node, path, f"must lie in {brackets[0]}{minimum}, {maximum}{brackets[1]}, got {text}")
            return None
        return value

    def boolean(self, node: Node, path: str) -> bool | None:
        text = self._scalar_text(node, path, "true or false")
        if text is None:
            return None
        if not node.style and text in _TRUE:
            return True
        if not node.style and text in _FALSE:
            return False
        self.problem(node, path, f"must be true or false, got {describe(node)}", ("true", "false"))
        return None

    def money(self, node: Node, path: str) -> int | None:
        """Decimal currency (a number or a quoted string) -> integer micro-units, exactly."""
        text = self._scalar_text(node, path, "an amount of currency")
        if text is None:
            return None
        if node.tag == BOOL and not node.style:
            self.problem(node, path, f"must be an amount of currency, got {describe(node)}")
            return None
        try:
            return parse_money(text)
        except ValueError as exc:
            self.problem(node, path, str(exc))
            return None

    def _bounded(self, node: Node, path: str, value: int, minimum: int | None, maximum: int | None) -> int | None:
        if minimum is not None and value < minimum:
            self.problem(node, path, f"must be >= {minimum}, got {value}")
            return None
        if maximum is not None and value > maximum:
            self.problem(node, path, f"must be <= {maximum}, got {value}")
            return None
        return value


class _AliasRefused(yaml.MarkedYAMLError):
    pass


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops at the first alias (*name, and so `<<: *name` merges too).

    An alias makes one node appear in many places; validation then reads it once per place, so a
    few KB of nested aliases ("billion laughs") are billions of values to check, and a long
    rule aliased thousands of times is millions. A policy gains nothing from aliases that is
    worth that: they are refused while composing, before anything is expanded."""

    def compose_node(self, parent: Node | None, index: object) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasRefused(None, None, f"aliases (*{event.anchor}) are not allowed in a policy document; "
                                            "write the value out", event.start_mark)
        return super().compose_node(parent, index)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(root: Node, reader: Reader) -> None:
    """Every scalar (keys included) must be encodable as UTF-8: a "\\ud800" escape in a double-
    quoted scalar decodes to a lone surrogate that no reply or store could write back. Iterative:
    the tree may be as deep as the parser allowed."""
    stack: list[tuple[Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, ScalarNode):
            if not node.value.isascii() and _SURROGATE.search(node.value):
                # The path may hold the same surrogates (a key): written as escapes, so the
                # problem itself can be sent back.
                shown = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", path)
                reader.problem(node, shown, "contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
        elif isinstance(node, SequenceNode):
            stack.extend((n, f"{path}[{i}]") for i, n in enumerate(node.value))
        elif isinstance(node, MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, ScalarNode) else "?"
                stack.append((k, path))
                stack.append((v, f"{path}.{key}" if path else key))


def compose(text: str, reader: Reader) -> Node | None:
    """The document's root node, or None with a problem (syntax error, several documents, empty,
    an alias, a lone surrogate)."""
    try:
        root = yaml.compose(text, Loader=_Loader)
    except _AliasRefused as exc:
        mark = exc.problem_mark
        reader.problems.append(Problem("", str(exc.problem), mark.line + 1, mark.column + 1))
        return None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(x for x in (exc.context, exc.problem) if x) or "YAML syntax error"
        line = mark.line + 1 if mark is not None else None
        column = mark.column + 1 if mark is not None else None
        reader.problems.append(Problem("", f"YAML syntax error: {message}", line, column))
        return None
    except yaml.YAMLError as exc:
        reader.problems.append(Problem("", f"YAML error: {exc}"))
        return None
    except RecursionError:
        reader.problems.append(Problem("", "the document is nested too deeply"))
        return None
    if root is None:
        reader.problems.append(Problem("", "the policy document is empty"))
        return None
    check_text(root, reader)
    return None if reader.problems else root
