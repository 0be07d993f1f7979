"""Per-request sampling options, validated at construction so bad input fails before queuing."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.structured_output import check_response_format

MAX_LOGPROBS = 20   # alternatives per token, as OpenAI's top_logprobs


class ParamError(RequestError):
    """A RequestError caused by one named parameter, so the HTTP edge can name it in its 400."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True)
class SamplingParams:
    """Options in the shape vLLM users know.

    temperature: 0 means greedy (exact argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 or -1: all). top_p: nucleus mass in (0, 1].
    seed: makes a sampled request reproducible: the random draw for output token i depends only on
      (seed, i), so the result is the same whatever else is batched with it and after preemption.
      Its prompt's last partial block is prefilled in a step of its own (tokenyard.engines.core.scheduler), so
      a cold and a warm prefix cache give the same logits, and the same output.
    max_tokens: the most tokens to generate; stop_token_ids end generation (the token is kept in
      the output ids, as vLLM does); ignore_eos keeps generating past the model's EOS tokens.
    stop: strings that end generation; they are cut from the text (applied by the detokeniser).
    response_format: None, {"type": "json_object"} or {"type": "json_schema", "schema": {...}}:
      the output is constrained by a grammar (tokenyard.engines.core.structured_output); not speculated.
    presence_penalty, frequency_penalty: in [-2, 2], OpenAI's rule: before temperature, each token's
      logit loses frequency_penalty * (times it occurs in the output so far) + presence_penalty * (1 if
      it occurs at all). Only output tokens count, not the prompt (as vLLM does).
    logit_bias: {token id: bias in [-100, 100]} added to the logits before temperature; -100 in effect
      forbids a token, +100 in effect forces it. Ids are checked against the vocabulary by the engine.
    logprobs: None (none reported), or k in [0, MAX_LOGPROBS]: each output token comes with its log
      probability and the k most likely tokens' (tokenyard.engines.core.outputs.StepOutput.logprobs). They are
      the model's distribution, log_softmax of the raw logits, before penalties, bias, grammar masks,
      temperature and top-k/top-p. Not speculated.
    lora: None (the base model) or the name of a LoRA adapter the engine serves (EngineConfig.lora_modules);
      an unknown name is refused when the request is added.
    Requests with a penalty or a bias are not speculated (a draft's verify rows would each need the
    counts of a different output prefix).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    response_format: dict[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is None:
            self.logit_bias = {}
        elif isinstance(self.logit_bias, dict):
            # JSON object keys are strings (OpenAI's logit_bias, a remote engine's wire format).
            self.logit_bias = {int(k) if isinstance(k, str) and k.isascii() and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        self.validate()

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise RequestError(f"unknown sampling option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**options)

    def validate(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0 or not math.isfinite(self.temperature):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise RequestError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise RequestError(f"stop_token_ids must be non-negative integers, got {tok!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError(f"stop strings must be non-empty strings, got {s!r}")
        if self.response_format is not None:
            check_response_format(self.response_format)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise ParamError(f"{name} must be a number in [-2, 2], got {value!r}", name)
        if not isinstance(self.logit_bias, dict):
            raise ParamError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}", "logit_bias")
        for tok, bias in self.logit_bias.items():
            if not _is_int(tok) or tok < 0:
                raise ParamError(f"logit_bias keys must be non-negative token ids, got {tok!r}", "logit_bias")
            if not _is_number(bias) or not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
                raise ParamError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}",
                                 "logit_bias")

        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ParamError(f"lora must be None or an adapter name, got {self.lora!r}", "lora")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ParamError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                             "logprobs")

    def check_vocab(self, vocab_size: int) -> None:
        """logit_bias ids must name tokens of this model."""
        bad = sorted(t for t in self.logit_bias if t >= vocab_size)
        if bad:
            raise ParamError(f"logit_bias token id {bad[0]} is not in the vocabulary [0, {vocab_size})", "logit_bias")

    @property
    def adjusts_logits(self) -> bool:
        """True when a penalty or a bias changes this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
