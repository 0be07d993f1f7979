"""`tools`, `tool_choice` and `parallel_tool_calls` of a chat request, validated.

    tools = parse_tools(body)     # None when the request has no tools
    tools.constraint()            # the response_format that forces a call (required / named), or None

What each tool_choice means here:
- "none": the tools are shown to the model (the conversation may refer to them) but the reply is
  plain text: nothing is parsed as a call.
- "auto" (the default with tools): the model decides; a call it writes in the format the prompt
  taught it is parsed into `tool_calls` (tokenyard/gateway/http/tool_calls.py).
- "required" and {"type": "function", "function": {"name": ...}}: constrained decoding (the same
  grammar engine as response_format) holds the reply to one call, {"name": ..., "arguments":
  {...}}, whose arguments follow that function's `parameters` schema.
`parallel_tool_calls` (default true) is honoured: false keeps at most one call of an "auto"
reply. A forced reply is always exactly one call.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenyard.gateway.edge.errors import BadRequest

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]       # a JSON Schema for the arguments object
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The function as the request described it (what templates that render tools expect)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True, slots=True)
class ToolSetup:
    tools: tuple[Tool, ...]
    choice: str                      # "none", "auto", "required" or "function"
    function: str | None = None      # the forced function's name when choice == "function"
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    def constraint(self) -> dict[str, Any] | None:
        """A response_format (the engine's json_schema shape) for a forced call, else None."""
        if not self.forced:
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t.name == self.function]
        calls = [_call_schema(t) for t in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return {"type": "json_schema", "name": "tool_call", "schema": schema, "strict": True}


def _call_schema(tool: Tool) -> dict[str, Any]:
    # "name" first: the grammar emits properties in this order, so a stream learns the name
    # before the arguments begin.
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(body: dict[str, Any]) -> ToolSetup | None:
    """The request's tools setup, or None when it has no tools (a tool_choice other than "none"
    without tools is a 400, as OpenAI answers it)."""
    raw_tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", param="parallel_tool_calls")
    if raw_tools is None or raw_tools == []:
        if choice is not None and choice != "none":
            raise BadRequest("'tool_choice' is only allowed when 'tools' are specified", param="tool_choice")
        return None
    if not isinstance(raw_tools, list):
        raise BadRequest("'tools' must be an array of function tools", param="tools")
    if len(raw_tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' has {len(raw_tools)} entries; at most {MAX_TOOLS}", param="tools")
    tools = tuple(_tool(t, i) for i, t in enumerate(raw_tools))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise BadRequest(f"tools: the function name {dup!r} appears more than once", param="tools")
    kind, function = _choice(choice, set(names))
    return ToolSetup(tools, kind, function, True if parallel is None else parallel)


def _tool(raw: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type") != "function":
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str):
            raise BadRequest(f"{where}.type {kind!r} is not supported (function tools only)", param=f"{where}.type",
                             code="unsupported_parameter")
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
    extra = sorted(set(raw) - {"type", "function"})
    if extra:
        raise BadRequest(f"{where}: unrecognized field {extra[0]!r}", param=f"{where}.{extra[0]}")
    fn = raw.get("function")
    if not isinstance(fn, dict):
        raise BadRequest(f"{where}.function must be an object", param=f"{where}.function")
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise BadRequest(f"{where}.function: unrecognized field {extra[0]!r}", param=f"{where}.function.{extra[0]}")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                         param=f"{where}.function.name")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise BadRequest(f"{where}.function.description must be a string", param=f"{where}.function.description")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise BadRequest(f"{where}.function.parameters must be a JSON Schema of type 'object'",
                         param=f"{where}.function.parameters")
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.function.strict must be a boolean", param=f"{where}.function.strict")
    return Tool(name, description, parameters, bool(strict))


def _choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise BadRequest(f"tool_choice names the function {name!r}, which is not in 'tools'",
                             param="tool_choice")
        return "function", name
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
