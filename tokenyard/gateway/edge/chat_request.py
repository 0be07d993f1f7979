"""A /v1/chat/completions body, validated into a typed request.

Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are parsed by tokenyard/gateway/edge/tool_request.py;
the conversation may carry assistant messages with `tool_calls` and `tool` messages answering them.

What the API defines but Tokenyard does not implement is refused with a 400 naming the
parameter (never silently ignored): a client that asks for tools or logprobs must learn at
once that it will not get them. A parameter set to its neutral value (n=1, logprobs=false,
presence_penalty=0, logit_bias={}, ...) is accepted, since SDKs and proxies often send those.
Names the API does not define at all are refused too, like OpenAI's "Unrecognized request
argument".
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.edge.tool_request import ToolSetup, parse_tools
from tokenyard.policies.schema import PRIORITIES

MAX_STOP = 4
MAX_N = 16            # choices per request; each is an engine sequence
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**63 - 1


def _is_neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == x and type(v) is type(x) for x in values) or v is None


# Parameter -> "is this value one we can honour by doing nothing?"
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "functions": lambda v: v is None or v == [],
    "function_call": _is_neutral("none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": lambda v: v is None,
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "store": _is_neutral(False),
    "verbosity": lambda v: v is None,
    "prompt_cache_key": lambda v: v is None,
    "safety_identifier": lambda v: v is None,
}
SUPPORTED = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
             "seed", "stream", "stream_options", "user", "metadata", "response_format", "presence_penalty",
             "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
             "service_tier", "priority")
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024   # entries; bounds the work one request adds to every decode step
# The request's admission class: OpenAI's service_tier ("flex" is the cheaper, slower lane) or our
# own `priority`. A request may always lower its class; it never rises above its key's class or a
# policy rule's (tokenyard/gateway/http/route_plan.py clamps). None keeps the key's / the policy's class.
SERVICE_TIERS = {"auto": None, "default": None, "flex": "batch", "priority": "interactive"}
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(slots=True, kw_only=True)
class SamplingRequest:
    """What chat and text completions share: the model, sampling, stop, stream, tags, penalties,
    logprobs. parse_common fills it for both; the shared flow (completion_flow.py) reads only these."""

    model: str
    max_tokens: int | None = None            # None: the deployment's default, capped by the context
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    # None (plain text), {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"}:
    # the engine's SamplingParams.response_format shape (the json_schema wrapper unwrapped). Chat only.
    response_format: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)   # ids checked against the vocabulary by the engine
    logprobs: int | None = None              # None: not asked; k: each token's logprob and k alternatives
    n: int = 1                               # choices; one prefill, shared through the prefix cache
    priority: int | None = None              # requested admission class index (service_tier / priority)
    top_k: int = 0                           # the engine's top-k (0: off); only the Messages API sets it
    api: str = "chat"                        # the client API it came in by (the usage record's `api`)
    # The body as the client sent it: what an upstream engine (type: openai) is sent, rewritten
    # (tokenyard/gateway/http/upstream_body.py). Not part of equality or repr (it may be large).
    body: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    prompt_chars: int | None = field(default=None, compare=False, repr=False)   # prompt_guard's count, once


@dataclass(slots=True, kw_only=True)
class ChatRequest(SamplingRequest):
    # {"role", "content": str}; an assistant's may add "tool_calls" (OpenAI's shape, arguments a
    # JSON string), a tool's has "tool_call_id".
    messages: list[dict[str, Any]]
    tools: ToolSetup | None = None


def parse_chat_request(body: Any, max_messages: int = 1024) -> ChatRequest:
    check_names(body, UNSUPPORTED, SUPPORTED)
    req = ChatRequest(model=parse_model(body), messages=_messages(body.get("messages"), max_messages), body=body)
    parse_common(body, req)
    req.response_format = _response_format(body.get("response_format"))
    req.logprobs = _logprobs(body.get("logprobs"), body.get("top_logprobs"))
    req.tools = parse_tools(body)
    if req.tools is not None and req.tools.forced:
        if req.response_format is not None:
            raise BadRequest("tool_choice 'required' or a named function cannot be combined with response_format: "
                             "the reply is held to the tool call", param="tool_choice")
        req.response_format = req.tools.constraint()
    return req


def check_names(body: Any, unsupported: dict[str, Callable[[Any], bool]], supported: tuple[str, ...]) -> None:
    """A JSON object whose every name is supported, or unsupported but set to its neutral value."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in body:
        if name in unsupported:
            if not unsupported[name](body[name]):
                raise BadRequest(f"'{name}' is not supported by Tokenyard", param=name, code="unsupported_parameter")
        elif name not in supported:
            raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name,
                             code="unrecognized_parameter")


def parse_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    return model


def parse_common(body: dict[str, Any], req: SamplingRequest) -> None:
    """The parameters chat and text completions share, set on req (a ChatRequest or a
    CompletionRequest): n, max_tokens, sampling, stop, stream, user, metadata, penalties, bias."""
    n = body.get("n")
    if n is not None:
        if not is_int(n) or not 1 <= n <= MAX_N:
            raise BadRequest(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", param="n")
        req.n = n
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise BadRequest(f"'{name}' must be an integer >= 1, got {value!r}", param=name)
        if req.max_tokens is not None and req.max_tokens != value:
            raise BadRequest("max_tokens and max_completion_tokens disagree; send one", param=name)
        req.max_tokens = value
    req.temperature = _number(body, "temperature", 1.0, lambda x: 0 <= x <= 2, "a number in [0, 2]")
    req.top_p = _number(body, "top_p", 1.0, lambda x: 0 < x <= 1, "a number in (0, 1]")
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not -MAX_SEED - 1 <= seed <= MAX_SEED):
        raise BadRequest(f"'seed' must be a 64-bit integer, got {seed!r}", param="seed")
    req.seed = seed
    req.stop = _stop(body.get("stop"))
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", param="stream")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not req.stream:
            raise BadRequest("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
            raise BadRequest("'stream_options' must be an object with 'include_usage'", param="stream_options")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise BadRequest("'stream_options.include_usage' must be a boolean", param="stream_options.include_usage")
        req.include_usage = include
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", param="user")
    req.user = user
    req.metadata = _metadata(body.get("metadata"))
    req.presence_penalty = _number(body, "presence_penalty", 0.0, lambda x: -2 <= x <= 2, "a number in [-2, 2]")
    req.frequency_penalty = _number(body, "frequency_penalty", 0.0, lambda x: -2 <= x <= 2, "a number in [-2, 2]")
    req.logit_bias = _logit_bias(body.get("logit_bias"))
    req.priority = _priority(body)


def _logprobs(logprobs: Any, top: Any) -> int | None:
    if logprobs is not None and not isinstance(logprobs, bool):
        raise BadRequest(f"'logprobs' must be a boolean, got {logprobs!r}", param="logprobs")
    if top is not None:
        if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                             param="top_logprobs")
        if not logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    return (top or 0) if logprobs else None


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]}; the keys are JSON strings of decimal ids."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must be an object mapping token ids to numbers in [-100, 100]",
                         param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        # isascii: "²".isdigit() is true but int("²") fails; an id has at most 10 digits.
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise BadRequest(f"'logit_bias' keys must be token ids (decimal integers), got {key!r}",
                             param="logit_bias")
        if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                or not -100 <= value <= 100):
            raise BadRequest(f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                             param="logit_bias")
        out[int(key)] = float(value)
    return out


def _response_format(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's response_format, shape-checked; whether the schema compiles is the engine's call."""
    param = "response_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest("'response_format' must be an object with a 'type'", param=param)
    kind = fmt["type"]
    if kind == "text":
        allowed: set[str] = {"type"}
    elif kind == "json_object":
        allowed = {"type"}
    elif kind == "json_schema":
        allowed = {"type", "json_schema"}
    else:
        raise BadRequest(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                         param=f"{param}.type")
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise BadRequest(f"response_format: unrecognized field {extra[0]!r}", param=f"{param}.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    spec = fmt.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise BadRequest("response_format of type 'json_schema' needs a 'json_schema' object", param=where)
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise BadRequest(f"{where}: unrecognized field {extra[0]!r}", param=f"{where}.{extra[0]}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise BadRequest(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                         param=f"{where}.name")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.schema must be a JSON Schema object", param=f"{where}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.strict must be a boolean", param=f"{where}.strict")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.description must be a string", param=f"{where}.description")
    # The output is always held to the schema, strict or not (a constraint costs nothing extra).
    return {"type": "json_schema", "name": name, "schema": schema, "strict": bool(strict)}


def _messages(messages: Any, max_messages: int) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    if len(messages) > max_messages:
        raise BadRequest(f"'messages' has {len(messages)} entries; at most {max_messages}", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role == "function":
            raise BadRequest(f"{where}.role 'function' is the deprecated form; use 'tool' messages",
                             param=f"{where}.role", code="unsupported_parameter")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role")
        for key in msg:
            if key in ("function_call", "audio") and msg[key] is not None:
                raise BadRequest(f"{where}.{key} is not supported by Tokenyard", param=f"{where}.{key}",
                                 code="unsupported_parameter")
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id", "function_call", "audio",
                           "refusal"):
                raise BadRequest(f"{where}: unrecognized field {key!r}", param=f"{where}.{key}")
        name = msg.get("name")
        if name is not None and not isinstance(name, str):
            raise BadRequest(f"{where}.name must be a string", param=f"{where}.name")
        calls = msg.get("tool_calls")
        if calls is not None and (role != "assistant" or calls == []):
            if calls == [] and role == "assistant":
                calls = None
            else:
                raise BadRequest(f"{where}.tool_calls is only allowed on assistant messages", param=f"{where}.tool_calls")
        if role == "assistant" and calls is not None:
            content = msg.get("content")
            text = "" if content is None or content == "" else _content(content, where)
            out.append({"role": role, "content": text, "tool_calls": _tool_calls(calls, f"{where}.tool_calls")})
            continue
        if msg.get("tool_call_id") is not None and role != "tool":
            raise BadRequest(f"{where}.tool_call_id is only allowed on tool messages", param=f"{where}.tool_call_id")
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise BadRequest(f"{where}: a tool message needs 'tool_call_id' (the id of the call it answers)",
                                 param=f"{where}.tool_call_id")
            out.append({"role": role, "content": _content(msg.get("content"), where), "tool_call_id": call_id})
            continue
        out.append({"role": role, "content": _content(msg.get("content"), where)})
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments": str}}]."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be an array", param=where)
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(call.get("id"), str) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments"), str)):
            raise BadRequest(f"{at} must be {{\"id\": string, \"type\": \"function\", \"function\": "
                             f"{{\"name\": string, \"arguments\": string}}}}", param=at)
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return out


def _content(content: Any, where: str) -> str:
    """A string, or an array of text parts (joined); images and audio are not supported."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise BadRequest(f"{where}.content[{j}]: content type {kind!r} is not supported (text only)",
                                     param=f"{where}.content", code="unsupported_parameter")
                raise BadRequest(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": string}}",
                                 param=f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}.content must be a string or a non-empty array of text parts",
                     param=f"{where}.content")


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("'stop' must be a non-empty string or an array of non-empty strings", param="stop")
    if len(stops) > MAX_STOP:
        raise BadRequest(f"'stop' has {len(stops)} strings; at most {MAX_STOP}", param="stop")
    return stops


def _priority(body: dict[str, Any]) -> int | None:
    """The admission class the request asks for (an index into PRIORITIES), or None."""
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise BadRequest(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}",
                         param="service_tier")
    named = body.get("priority")
    if named is not None and named not in PRIORITIES:
        raise BadRequest(f"'priority' must be one of {', '.join(PRIORITIES)}, got {named!r}", param="priority")
    from_tier = SERVICE_TIERS.get(tier) if tier is not None else None
    if named is not None and from_tier is not None and named != from_tier:
        raise BadRequest(f"'priority' {named!r} and 'service_tier' {tier!r} disagree; send one", param="priority")
    chosen = named or from_tier
    return PRIORITIES.index(chosen) if chosen is not None else None


def _metadata(meta: Any) -> dict[str, str]:
    if meta is None:
        return {}
    if (not isinstance(meta, dict) or len(meta) > 16
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in meta.items())):
        raise BadRequest("'metadata' must map at most 16 string keys (<= 64 chars) to strings (<= 512 chars)",
                         param="metadata")
    return dict(meta)


def _number(body: dict[str, Any], name: str, default: float, ok: Callable[[float], bool], what: str) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok(value):
        raise BadRequest(f"'{name}' must be {what}, got {value!r}", param=name)
    return float(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
