"""An Anthropic Messages API body (POST /v1/messages), translated into the chat request the one flow
runs (tokenyard/gateway/edge/chat_request.py): the Messages API is a translation at the edge, never a
second flow.

    req = parse_messages_request(body, max_messages)     # a ChatRequest, api "messages"

What maps to what:
- `system` (a string or text blocks) -> a leading system message.
- `messages`: user / assistant turns whose content is a string or blocks. text -> content;
  an assistant's tool_use {id, name, input} -> its tool_calls (arguments: input as JSON text);
  a user's tool_result {tool_use_id, content, is_error} -> a tool message (in block order, so a
  turn of results then text is the tool messages then a user message).
- `tools` [{name, description, input_schema}] -> function tools; `tool_choice` {type: auto | any |
  tool | none} -> "auto" | "required" | the named function | "none"; disable_parallel_tool_use ->
  parallel_tool_calls false.
- `stop_sequences` -> stop; `max_tokens` (required, as Anthropic's); `temperature` (0..1), `top_p`,
  `top_k` (the engine's top-k); `metadata.user_id` -> user; `stream`.
- `cache_control` on any block or tool is accepted and ignored: the engine's prefix cache reuses
  a repeated prompt prefix on its own, with no marker.
What the gateway cannot honour is a 400 naming the field: image and document blocks, thinking,
server tools (web search, code execution, ...), MCP servers, a final assistant turn (prefill: the
chat template would open a new assistant turn rather than continue it). Unknown names are 400s too.
"""
from __future__ import annotations

import json
from typing import Any

from tokenyard.gateway.edge.chat_request import MAX_STOP, ChatRequest, is_int, parse_chat_request
from tokenyard.gateway.edge.errors import BadRequest

SUPPORTED = ("model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
             "metadata", "stream", "tools", "tool_choice", "cache_control", "service_tier")
# Anthropic's names the gateway does not implement: refused unless set to a value that asks for nothing.
UNSUPPORTED = {
    "thinking": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "disabled"),
    "mcp_servers": lambda v: v is None or v == [],
    "container": lambda v: v is None,
    "context_management": lambda v: v is None,
}
SERVICE_TIERS = ("auto", "standard_only")     # both mean "whatever lane the key has" here
ROLES = ("user", "assistant")
MAX_TOP_K = 1_000_000


def parse_messages_request(body: Any, max_messages: int = 1024) -> ChatRequest:
    """The Messages API body -> a validated ChatRequest (its `body` is the translated chat body,
    what an upstream engine is sent)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name in UNSUPPORTED:
            if not UNSUPPORTED[name](body[name]):
                raise BadRequest(f"{name}: not supported by Tokenyard", param=name, code="unsupported_parameter")
        elif name not in SUPPORTED:
            raise BadRequest(f"{name}: Extra inputs are not permitted", param=name, code="unrecognized_parameter")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens: Field required", param="max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise BadRequest(f"max_tokens: must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise BadRequest(f"service_tier: must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}",
                         param="service_tier")
    chat: dict[str, Any] = {"model": body.get("model"), "max_tokens": max_tokens,
                            "messages": _system(body.get("system")) + _messages(body.get("messages"), max_messages)}
    temperature = body.get("temperature")
    if temperature is not None:
        if not _number(temperature) or not 0 <= temperature <= 1:
            raise BadRequest(f"temperature: must be a number in [0, 1], got {temperature!r}", param="temperature")
        chat["temperature"] = temperature
    for name in ("top_p", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise BadRequest("stop_sequences: must be an array of non-empty strings", param="stop_sequences")
        if len(stops) > MAX_STOP:
            raise BadRequest(f"stop_sequences: {len(stops)} given; at most {MAX_STOP}", param="stop_sequences")
        if stops:
            chat["stop"] = stops
    user = _user(body.get("metadata"))
    if user is not None:
        chat["user"] = user
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"], parallel = _tool_choice(choice)
        if parallel is not None:
            chat["parallel_tool_calls"] = parallel
    req = parse_chat_request(chat, max_messages + 1)   # + 1: the system message
    req.top_k = _top_k(body.get("top_k"))
    if req.top_k and req.body is not None:
        req.body["top_k"] = req.top_k   # what an upstream engine is sent (vLLM and SGLang take it)
    req.api = "messages"
    return req


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _top_k(value: Any) -> int:
    if value is None:
        return 0
    if not is_int(value) or not 0 <= value <= MAX_TOP_K:
        raise BadRequest(f"top_k: must be an integer in [0, {MAX_TOP_K}], got {value!r}", param="top_k")
    return value


def _user(meta: Any) -> str | None:
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise BadRequest("metadata: must be an object", param="metadata")
    extra = sorted(set(meta) - {"user_id"})
    if extra:
        raise BadRequest(f"metadata.{extra[0]}: Extra inputs are not permitted", param=f"metadata.{extra[0]}")
    user = meta.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise BadRequest("metadata.user_id: must be a string of at most 256 characters", param="metadata.user_id")
    return user


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None or system == "" or system == []:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if isinstance(system, list):
        return [{"role": "system", "content": "".join(_text_block(b, f"system[{i}]") for i, b in enumerate(system))}]
    raise BadRequest("system: must be a string or an array of text blocks", param="system")


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        _refuse_block(block, where)
        raise BadRequest(f"{where}: must be {{\"type\": \"text\", \"text\": string}}", param=where)
    _known(block, where, ("type", "text", "cache_control", "citations"))
    return block["text"]


def _refuse_block(block: Any, where: str) -> None:
    """A block of a kind the gateway does not take: a 400 that names it and says why."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document", "search_result"):
        raise BadRequest(f"{where}: {kind} content blocks are not supported by Tokenyard (text only)",
                         param=f"{where}.type", code="unsupported_parameter")
    if kind in ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                "container_upload", "mcp_tool_use", "mcp_tool_result"):
        raise BadRequest(f"{where}: {kind} blocks are not supported by Tokenyard", param=f"{where}.type",
                         code="unsupported_parameter")


def _known(obj: dict[str, Any], where: str, names: tuple[str, ...]) -> None:
    extra = sorted(set(obj) - set(names))
    if extra:
        raise BadRequest(f"{where}.{extra[0]}: Extra inputs are not permitted", param=f"{where}.{extra[0]}")


def _messages(messages: Any, max_messages: int) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: must be a non-empty array", param="messages")
    if len(messages) > max_messages:
        raise BadRequest(f"messages: {len(messages)} given; at most {max_messages}", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where}: must be an object", param=where)
        _known(msg, where, ("role", "content"))
        role = msg.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role: must be 'user' or 'assistant', got {role!r}", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_user_turn(content, where) if role == "user" else [_assistant_turn(content, where)])
        else:
            raise BadRequest(f"{where}.content: must be a string or an array of content blocks",
                             param=f"{where}.content")
    if messages[-1].get("role") == "assistant":
        raise BadRequest(f"messages[{len(messages) - 1}]: a final assistant turn (prefill) is not supported by "
                         "Tokenyard; end the conversation with a user turn", param=f"messages[{len(messages) - 1}]",
                         code="unsupported_parameter")
    return out


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks -> tool messages (one per tool_result) and user messages (runs of text)."""
    out: list[dict[str, Any]] = []
    text: list[str] | None = None
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_result":
            _known(block, at, ("type", "tool_use_id", "content", "is_error", "cache_control"))
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{at}.tool_use_id: must be a non-empty string", param=f"{at}.tool_use_id")
            is_error = block.get("is_error")
            if is_error is not None and not isinstance(is_error, bool):
                raise BadRequest(f"{at}.is_error: must be a boolean", param=f"{at}.is_error")
            result = _result_text(block.get("content"), at)
            # The chat template has no error flag for a result; the model reads it in the text.
            out.append({"role": "tool", "tool_call_id": call_id, "content": f"Error: {result}" if is_error else result})
            text = None
        else:
            piece = _text_block(block, at)
            if text is None:
                text = []
                out.append({"role": "user", "content": ""})
            text.append(piece)
            out[-1]["content"] = "".join(text)
    if not out:
        raise BadRequest(f"{where}.content: must not be empty", param=f"{where}.content")
    return out


def _result_text(content: Any, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_block(b, f"{at}.content[{k}]") for k, b in enumerate(content))
    raise BadRequest(f"{at}.content: must be a string or an array of text blocks", param=f"{at}.content")


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, dict) and block.get("type") == "tool_use":
            _known(block, at, ("type", "id", "name", "input", "cache_control"))
            if not isinstance(block.get("id"), str) or not block["id"]:
                raise BadRequest(f"{at}.id: must be a non-empty string", param=f"{at}.id")
            if not isinstance(block.get("name"), str) or not block["name"]:
                raise BadRequest(f"{at}.name: must be a non-empty string", param=f"{at}.name")
            if not isinstance(block.get("input"), dict):
                raise BadRequest(f"{at}.input: must be an object", param=f"{at}.input")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        else:
            text.append(_text_block(block, at))
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools: must be an array", param="tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise BadRequest(f"{where}: must be an object", param=where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise BadRequest(f"{where}.type: server tool {kind!r} is not supported by Tokenyard (custom tools only)",
                             param=f"{where}.type", code="unsupported_parameter")
        _known(tool, where, ("type", "name", "description", "input_schema", "cache_control"))
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise BadRequest(f"{where}.input_schema: must be a JSON Schema object", param=f"{where}.input_schema")
        fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, bool | None]:
    """(the chat tool_choice, parallel_tool_calls or None) for Anthropic's tool_choice."""
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise BadRequest("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
                         param="tool_choice")
    kind = choice["type"]
    _known(choice, "tool_choice", ("type", "name", "disable_parallel_tool_use") if kind == "tool" else
           ("type",) if kind == "none" else ("type", "disable_parallel_tool_use"))
    off = choice.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use: must be a boolean",
                         param="tool_choice.disable_parallel_tool_use")
    parallel = None if off is None else not off
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("tool_choice.name: must name one of the tools", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel
