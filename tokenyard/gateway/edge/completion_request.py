"""A /v1/completions body (OpenAI's legacy text completion), validated into a typed request.

The parameters it shares with chat (sampling, stop, stream, penalties, bias, user, metadata) are
parsed by chat_request.parse_common, so both endpoints accept and refuse them alike. What is
particular here: `prompt` (a string, an array of token ids, or a batch: an array of several of either; no chat
template is applied),
`logprobs` as an integer 0..MAX_LOGPROBS, and `echo`, `suffix`, `best_of` refused by name unless
neutral.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from tokenyard.gateway.edge.chat_request import SamplingRequest, check_names, is_int, parse_common, parse_model
from tokenyard.gateway.edge.errors import BadRequest

MAX_LOGPROBS = 5      # OpenAI's limit for the legacy endpoint
MAX_PROMPTS = 32      # prompts in one batch
MAX_CHOICES = 64      # prompts x n: each choice is an engine sequence
MAX_PROMPT_IDS = 1_000_000   # far above any context; bounds the work before the context check

UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or (is_int(v) and v == 1),
}
SUPPORTED = ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
             "stream_options", "user", "metadata", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
             "service_tier", "priority")


@dataclass(slots=True, kw_only=True)
class CompletionRequest(SamplingRequest):
    prompt: str | list[int]                  # text (tokenised as is, no template) or token ids: the routed one
    # Every prompt of the request, in order (one, or a batch). The batch goes to one engine, routed
    # by its longest prompt (`prompt`); each prompt gets n choices, indexed prompt * n + choice.
    prompts: list[str | list[int]] = field(default_factory=list)


def parse_completion_request(body: Any) -> CompletionRequest:
    check_names(body, UNSUPPORTED, SUPPORTED)
    prompts = _prompts(body.get("prompt"))
    req = CompletionRequest(model=parse_model(body), prompt=max(prompts, key=len), prompts=prompts, body=body)
    parse_common(body, req)
    if len(prompts) * req.n > MAX_CHOICES:
        raise BadRequest(f"{len(prompts)} prompts x n={req.n} is {len(prompts) * req.n} choices; at most {MAX_CHOICES}",
                         param="n")
    lp = body.get("logprobs")
    if lp is not None and (not is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise BadRequest(f"'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {lp!r}", param="logprobs")
    req.logprobs = lp
    return req


def _prompts(prompt: Any) -> list[str | list[int]]:
    """A string, an array of token ids, or a batch: an array of strings and/or token-id arrays."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS}", param="prompt")
        return [_prompt(p) for p in prompt]
    return [_prompt(prompt)]


def _prompt(prompt: Any) -> str | list[int]:
    """One string, or one array of token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' must be a non-empty string", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        if len(prompt) > MAX_PROMPT_IDS or not all(t >= 0 for t in prompt):
            raise BadRequest("'prompt' token ids must be non-negative integers", param="prompt")
        return list(prompt)
    raise BadRequest("'prompt' must be a non-empty string, a non-empty array of token ids, or an array of those",
                     param="prompt")
