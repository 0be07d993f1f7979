"""Turn a chat (a list of messages) into prompt text with the model's own Jinja template.

The rendering follows Hugging Face's `apply_chat_template`, because templates are written and
tested against it: a sandboxed, immutable Jinja environment with trim_blocks and lstrip_blocks,
the loop-control extension, `raise_exception(msg)` and `strftime_now(fmt)` globals, a `tojson`
filter that keeps non-ASCII text (json.dumps with ensure_ascii=False, not Jinja's HTML-escaping
one), and the variables messages, tools, documents, add_generation_prompt, bos_token,
eos_token. `{% generation %}` blocks (HF's assistant-mask marker) render their body unchanged.

A tokenizer without a template gets `FALLBACK_CHAT_TEMPLATE` (ChatML) rather than an error, so
base models can still be chatted with; the prompt shape is then ours, not the model's.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from tokenyard.engines.core.errors import CheckpointError, RequestError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then "<|im_start|>assistant\n".
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(RequestError):
    """The template refused the conversation (raise_exception) or failed while rendering it."""


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages must be a non-empty list of {"role": known role, "content": str, ...} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}, got {role!r}")
        if not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{i}].content must be a string")
    return list(messages)


def renders_tools(tokenizer_or_template: Any) -> bool:
    """Whether the template does something with `tools` (Qwen2.5's and Llama 3.1's do; ChatML
    and SmolLM2's do not): the caller describes the tools some other way when it does not."""
    template = tokenizer_or_template if isinstance(tokenizer_or_template, str) else (
        getattr(tokenizer_or_template, "chat_template", None) or FALLBACK_CHAT_TEMPLATE)
    return _mentions_tools(template)


def tool_style(tokenizer_or_template: Any) -> str:
    """How tools reach this model (tokenyard/gateway/prompt/tool_prompt.py): "template" when its template renders
    them, "smollm2" for SmolLM2-Instruct's template (no tools in it, but the model card documents a
    <tool_call>[...]</tool_call> format), else "tags" (a preamble of ours)."""
    template = tokenizer_or_template if isinstance(tokenizer_or_template, str) else (
        getattr(tokenizer_or_template, "chat_template", None) or FALLBACK_CHAT_TEMPLATE)
    if _mentions_tools(template):
        return "template"
    # SmolLM2-Instruct's template writes its default system prompt, which names the model.
    return "smollm2" if "named SmolLM" in template else "tags"


@lru_cache(maxsize=32)
def _mentions_tools(template: str) -> bool:
    try:
        return any(node.name == "tools" for node in _ENV.parse(template).find_all(nodes.Name))
    except jinja2.TemplateSyntaxError:
        return False    # _compile reports the broken template when it is rendered


def apply_chat_template(tokenizer_or_template: Any, messages: Sequence[dict[str, Any]],
                        add_generation_prompt: bool = True, tokenize: bool = False,
                        tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                        **template_kwargs: Any) -> str | list[int]:
    """Render messages into prompt text (or its token ids with tokenize=True).

    tokenizer_or_template: an engines Tokenizer (its chat_template, or the fallback, with its
    bos_token and eos_token) or a template string (pass bos_token=..., eos_token=... yourself).
    Token ids are encoded without adding special tokens, since the template writes BOS itself.
    """
    if isinstance(tokenizer_or_template, str):
        if tokenize:
            raise ValueError("tokenize=True needs a tokenizer, not a template string")
        template, specials = tokenizer_or_template, {}
    else:
        tok = tokenizer_or_template
        template = tok.chat_template or FALLBACK_CHAT_TEMPLATE
        specials = {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)) if v is not None}
    text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                tools=tools, documents=documents, **{**specials, **template_kwargs})
    return tokenizer_or_template.encode(text, add_special_tokens=False) if tokenize else text


def render_chat_template(template: str, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                         **variables: Any) -> str:
    """Render one template; variables (bos_token, eos_token, tools, ...) go to the template as given."""
    messages = validate_messages(messages)
    variables.setdefault("tools", None)  # HF always defines these, so `tools is none` works
    variables.setdefault("documents", None)
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, SecurityError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # The template met a conversation shape it does not handle: the request's problem.
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; we only render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compiled once per template text; a broken template is the checkpoint's fault, not the request's."""
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"chat template does not compile: {e}") from e
