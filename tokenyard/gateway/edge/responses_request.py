"""A /v1/responses body (OpenAI's Responses API), validated and translated into a chat request.

The Responses API is a thin translation at the edge: its body becomes a /v1/chat/completions body
and goes through `parse_chat_request` and the one request flow, so every limit, route, admission
and spend rule is the chat path's.

    draft = parse_responses_request(body)           # shape checks; the stored conversation not read yet
    req = draft.chat_request(previous, max_messages) # previous: the stored conversation's chat messages

What maps to what:
- `instructions` -> a leading system message (not carried over by `previous_response_id`, as OpenAI's);
  `input` (a string: one user message; or items) -> messages: message items (roles user, system,
  developer, assistant; content a string or input_text / output_text parts), `function_call` items
  -> an assistant message's tool_calls (call_id as the call's id), `function_call_output` items ->
  tool messages.
- `tools` (Responses' flat {type: function, name, parameters, ...}) -> chat's nested function
  tools; `tool_choice` "none" / "auto" / "required" / {type: function, name}; `parallel_tool_calls`.
- `text.format` (text / json_object / json_schema {name, schema, strict}) -> response_format.
- `max_output_tokens` -> max_tokens; temperature, top_p, metadata, user, stream, service_tier.

What Tokenyard cannot honour is a 400 naming the field (param set), never silently ignored:
built-in tools (web_search, file_search, computer use, code interpreter, MCP, ...), reasoning
items and `reasoning`, `background: true`, `include` of anything, `conversation`, `prompt`
templates, images, files and audio in the input, and item references.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenyard.gateway.edge.chat_request import ChatRequest, check_names, parse_chat_request, parse_model
from tokenyard.gateway.edge.errors import BadRequest

# Parameter -> "is this value one we can honour by doing nothing?"
UNSUPPORTED = {
    "background": lambda v: v is None or v is False,
    "reasoning": lambda v: v is None,
    "include": lambda v: v is None or v == [],
    "conversation": lambda v: v is None,
    "prompt": lambda v: v is None,
    "max_tool_calls": lambda v: v is None,
    "top_logprobs": lambda v: v is None or (v == 0 and v is not False),
    "prompt_cache_key": lambda v: v is None,
    "prompt_cache_retention": lambda v: v is None,
    "prompt_cache_options": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
    "context_management": lambda v: v is None or v == [],
    "moderation": lambda v: v is None,
    "background_options": lambda v: v is None,
    "access_programs": lambda v: v is None,
    "image": lambda v: v is None,
    "truncation": lambda v: v is None or v == "disabled",
}
SUPPORTED = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "metadata", "user",
             "stream", "stream_options", "store", "previous_response_id", "tools", "tool_choice",
             "parallel_tool_calls", "text", "service_tier", "priority")
INPUT_ROLES = ("user", "system", "developer", "assistant")
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer", "computer_use",
                  "computer_use_preview", "code_interpreter", "image_generation", "mcp", "local_shell", "shell",
                  "apply_patch", "custom", "namespace", "tool_search")
MAX_ID = 64


@dataclass(slots=True)
class ResponsesDraft:
    """The request as validated before the stored conversation (previous_response_id) is read."""

    body: dict[str, Any]                 # the Responses body as sent
    chat_body: dict[str, Any]            # the chat body, less its messages
    instructions: str | None
    input_messages: list[dict[str, Any]]  # this turn's input as chat messages (instructions not included)
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    echo: dict[str, Any] = field(default_factory=dict)   # what the response object repeats of the request

    def chat_request(self, previous: list[dict[str, Any]], max_messages: int) -> ChatRequest:
        """The chat request of this turn: instructions, the stored conversation, then this input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = system + previous + self.input_messages
        body = {**self.chat_body, "messages": messages}
        try:
            return parse_chat_request(body, max_messages)
        except BadRequest as e:
            e.param = _responses_param(e.param)
            raise

    def conversation(self, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What a later turn's previous_response_id continues from (the output is added when stored)."""
        return previous + self.input_messages


def parse_responses_request(body: Any) -> ResponsesDraft:
    check_names(body, UNSUPPORTED, SUPPORTED)
    model = parse_model(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    if "input" not in body or body["input"] is None:
        raise BadRequest("'input' is required: a string or an array of input items", param="input")
    messages = _input(body["input"])
    chat: dict[str, Any] = {"model": model}
    for name in ("temperature", "top_p", "metadata", "user", "stream", "service_tier", "priority",
                 "parallel_tool_calls"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(body.get("tool_choice"))
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise BadRequest(f"'store' must be a boolean, got {store!r}", param="store")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous or len(previous) > MAX_ID):
        raise BadRequest(f"'previous_response_id' must be a response id (at most {MAX_ID} characters)",
                         param="previous_response_id")
    _stream_options(body)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": previous, "store": store is not False,
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": "disabled", "user": body.get("user")}
    return ResponsesDraft(body, chat, instructions, messages, store is not False, previous,
                          body.get("stream") is True, echo)


def _stream_options(body: dict[str, Any]) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if body.get("stream") is not True:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
        raise BadRequest("'stream_options' must be an object with at most 'include_obfuscation'",
                         param="stream_options")
    # No obfuscation padding is ever added: true or false, the events are the same.
    if not isinstance(options.get("include_obfuscation", False), bool):
        raise BadRequest("'stream_options.include_obfuscation' must be a boolean",
                         param="stream_options.include_obfuscation")


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("'input' must be a string or a non-empty array of input items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _message(item, where, out)
        elif kind == "function_call":
            _function_call(item, where, out)
        elif kind == "function_call_output":
            _only(item, where, {"type", "call_id", "output", "id", "status"})
            call_id = _string(item, "call_id", where)
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{where}.output", ("input_text",), allow_empty=True)})
        elif kind == "reasoning":
            raise BadRequest(f"{where}: reasoning items are not supported by Tokenyard", param=f"{where}.type",
                             code="unsupported_parameter")
        elif isinstance(kind, str):
            raise BadRequest(f"{where}: input item type {kind!r} is not supported (message, function_call and "
                             f"function_call_output only)", param=f"{where}.type", code="unsupported_parameter")
        else:
            raise BadRequest(f"{where} must be a message ({{\"role\", \"content\"}}) or have a 'type'", param=where)
    return out


def _message(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    _only(item, where, {"type", "role", "content", "id", "status", "phase"})
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(INPUT_ROLES)}, got {role!r}", param=f"{where}.role")
    kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    if role == "assistant":   # an earlier output item sent back, or the client's own assistant turn
        kinds = ("output_text", "refusal", "input_text")
    out.append({"role": role, "content": _text(item.get("content"), f"{where}.content", kinds)})


def _function_call(item: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    """A call the model made, sent back: joins the assistant message right before it, if any."""
    _only(item, where, {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller"})
    call = {"id": _string(item, "call_id", where), "type": "function",
            "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where, True)}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _text(content: Any, where: str, kinds: tuple[str, ...], allow_empty: bool = False) -> str:
    """A string, or an array of text parts (joined). Images, files and audio are not supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and (content or allow_empty):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in kinds:
                if isinstance(kind, str):
                    raise BadRequest(f"{where}[{j}]: content type {kind!r} is not supported here (text only: "
                                     f"{', '.join(kinds)})", param=f"{where}[{j}].type", code="unsupported_parameter")
                raise BadRequest(f"{where}[{j}] must be {{\"type\": \"{kinds[0]}\", \"text\": string}}",
                                 param=f"{where}[{j}]")
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise BadRequest(f"{where}[{j}] must carry its text as a string", param=f"{where}[{j}]")
            parts.append(text)
        return "".join(parts)
    raise BadRequest(f"{where} must be a string or a non-empty array of text parts", param=where)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat's {type: function, function: {...}}."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            if isinstance(kind, str):
                what = "built-in tool" if kind.split("_20")[0] in BUILT_IN_TOOLS else "tool type"
                raise BadRequest(f"{where}: {what} {kind!r} is not supported by Tokenyard (function tools only)",
                                 param=f"{where}.type", code="unsupported_parameter")
            raise BadRequest(f"{where} must be {{\"type\": \"function\", \"name\": ..., \"parameters\": {{...}}}}",
                             param=where)
        _only(tool, where, {"type", "name", "description", "parameters", "strict", "defer_loading",
                            "allowed_callers", "output_schema"})
        for name, neutral in (("defer_loading", (None, False)), ("output_schema", (None,)),
                              ("allowed_callers", (None, ["direct"]))):
            if tool.get(name) not in neutral:
                raise BadRequest(f"{where}.{name} is not supported by Tokenyard", param=f"{where}.{name}",
                                 code="unsupported_parameter")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        _only(choice, "tool_choice", {"type", "name"})
        if not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice of type 'function' needs the function's 'name'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if isinstance(kind, str):
        raise BadRequest(f"tool_choice of type {kind!r} is not supported by Tokenyard (function tools only)",
                         param="tool_choice", code="unsupported_parameter")
    raise BadRequest("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                     param="tool_choice")


def _text_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (its json_schema fields sit one level deeper there)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object with 'format'", param="text")
    _only(text, "text", {"format", "verbosity"})
    if text.get("verbosity") is not None:
        raise BadRequest("'text.verbosity' is not supported by Tokenyard", param="text.verbosity",
                         code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("'text.format' must be an object with a 'type'", param="text.format")
    if fmt["type"] != "json_schema":
        return fmt
    _only(fmt, "text.format", {"type", "name", "schema", "strict", "description"})
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _responses_param(param: str | None) -> str | None:
    """A chat parameter named in an error, as the Responses body names it."""
    if param is None:
        return None
    for chat, ours in (("max_tokens", "max_output_tokens"), ("response_format.json_schema", "text.format"),
                       ("response_format", "text.format"), ("messages", "input")):
        if param == chat or param.startswith(chat + ".") or param.startswith(chat + "["):
            return ours + param[len(chat):] if chat != "messages" else "input"
    if param.startswith("tools[") and ".function." in param:
        return param.replace(".function.", ".", 1)
    return param


def _only(item: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(set(item) - allowed)
    if extra:
        raise BadRequest(f"{where}: unrecognized field {extra[0]!r}", param=f"{where}.{extra[0]}")


def _string(item: dict[str, Any], name: str, where: str, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise BadRequest(f"{where}.{name} must be a {'' if empty else 'non-empty '}string", param=f"{where}.{name}")
    return value
