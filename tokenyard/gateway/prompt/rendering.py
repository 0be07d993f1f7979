"""The prompt of one request, rendered and encoded: the step before the route plan, which decides
with the token ids it hands over.

    prompt = RenderedPrompt(req)
    ids = prompt.ids(tokenizer)          # chat template + tools + encode, once per tokenizer
    prompt.replace_messages(kept)        # a policy's context limit dropped old turns: encodings reset

A chat goes through the model's chat template, with tools as the template renders them, else in the
model's documented format or a system preamble (tokenyard/gateway/prompt/tool_prompt.py); a text
completion's prompt is encoded as is, or taken as token ids, which must be in the vocabulary.
Engines whose tokenizers are one object (byte-identical files: engine_pool.py shares them) share one
encoding, so a request is templated and encoded once per distinct tokenizer it meets, whatever the
number of engines routing, the context check and a fallback consider.
"""
from __future__ import annotations

from typing import Any

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.text.chat_template import ChatTemplateError, apply_chat_template, tool_style
from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.completion_request import CompletionRequest
from tokenyard.gateway.edge.errors import BadRequest, Unprocessable
from tokenyard.gateway.edge.tool_request import ToolSetup
from tokenyard.gateway.prompt.tool_prompt import template_messages


class RenderedPrompt:
    """The request's routed prompt, encoded per tokenizer on first use (cached by identity)."""

    def __init__(self, req: ChatRequest | CompletionRequest) -> None:
        self.req = req
        self._ids: dict[int, tuple[Any, list[int]]] = {}

    def ids(self, tok: Any) -> list[int]:
        hit = self._ids.get(id(tok))
        if hit is not None and hit[0] is tok:
            return hit[1]
        req = self.req
        ids = tokenize_prompt(tok, req.prompt) if isinstance(req, CompletionRequest) else \
            tokenize(tok, req.messages, req.tools)
        self._ids[id(tok)] = (tok, ids)
        return ids

    def replace_messages(self, messages: list[dict[str, Any]], tok: Any, ids: list[int]) -> None:
        """The chat's messages after a trim; `ids` their encoding with `tok` (the others are recomputed)."""
        assert isinstance(self.req, ChatRequest)
        self.req.messages = messages
        self._ids = {id(tok): (tok, ids)}


def tokenize(tok: Tokenizer, messages: list[dict[str, Any]], tools: ToolSetup | None = None) -> list[int]:
    """The chat through the model's template; tools as the template renders them, else in the
    model's documented format or a system preamble (tokenyard/gateway/prompt/tool_prompt.py)."""
    messages, template_tools = template_messages(messages, tools, tool_style(tok))
    try:
        text = apply_chat_template(tok, messages, add_generation_prompt=True, tools=template_tools)
    except ChatTemplateError as e:
        raise Unprocessable(f"The model's chat template rejected the conversation: {e}", param="messages",
                            code="chat_template_error") from e
    except RequestError as e:
        raise BadRequest(str(e), param="messages") from e
    assert isinstance(text, str)
    return tok.encode(text, add_special_tokens=False)  # the template already wrote BOS


def tokenize_prompt(tok: Tokenizer, prompt: str | list[int]) -> list[int]:
    """A text completion's prompt: the text encoded as is (with the tokenizer's BOS, no chat
    template), or token ids, which must be in this engine's vocabulary."""
    if isinstance(prompt, str):
        return tok.encode(prompt)
    bad = next((t for t in prompt if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise BadRequest(f"prompt token id {bad} is outside the model's vocabulary (0..{tok.vocab_size - 1})",
                         param="prompt")
    return list(prompt)
