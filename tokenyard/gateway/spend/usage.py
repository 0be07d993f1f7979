"""What one request used, kept when it ends however it ends (finished, aborted, failed).

A `UsageSink` is any callable taking a record. The gateway fans each record out to the
in-memory `RecentUsage` (the access log and tests read it) and, with Redis configured, to the
spend ledger (tokenyard/gateway/spend/ledger.py), which stores it exactly once by `request_id`.

A record keeps the request's features that the policy what-if replay needs (token counts,
requested model, served engine, route reason, router score, tags, deadline, tenant, key) and
never any prompt or completion text.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

log = logging.getLogger("tokenyard.usage")


@dataclass(slots=True)
class RecordContext:
    """Who asked and how: the parts of a usage record known before the engine runs."""

    tenant: str = ""
    key_id: str = ""
    client_request_id: str = ""        # x-request-id as the client saw it (may repeat across requests)
    tags: dict[str, str] = field(default_factory=dict)   # the request's metadata (never prompt text)
    user: str | None = None
    router_score: float | None = None  # None: no learned router configured (or a pinned engine)
    deadline_ms: int | None = None     # the request's start deadline budget
    baseline_engine: str = ""          # the "large" engine savings are measured against
    baseline_prices: Any = None        # its deployment.Prices
    # What the policy decided with, so the what-if replay sees the same features.
    key_name: str = ""
    requested_max_tokens: int | None = None   # what the client asked (None: not set); max_tokens is what ran
    engine_state: dict[str, dict[str, Any]] | None = None   # {engine: {predicted_ttft_ms, healthy}} at decision
    prices: Any = None                 # deployment.Prices from the policy in force (None: the engine's own)
    policy_version: int = 0            # the policy version that routed and priced it (0: built-in, no policy)
    context_dropped_tokens: int = 0    # prompt tokens the policy's context limit trimmed away (oldest turns)
    routed_prompt_tokens: int = 0      # the prompt count the policy decided with (0: not known)
    batch: bool = False                # a Batch API line (charged the batch price)
    api: str = "chat"                  # the client API the request came in by: chat, messages, responses
    lora: str = ""                     # the engine's LoRA adapter that served it ("": the base)


@dataclass(slots=True)
class UsageRecord:
    request_id: str                # unique per request (the client's id + a gateway suffix): the ledger's key
    time: float                    # unix seconds when the request arrived
    engine: str
    requested_model: str
    route_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int               # from the engine's prices, integer micro-units
    status: str                    # "ok", "client_disconnected", "slow_client", "error", "draining", "rejected"
    finish_reason: str | None
    ttft_s: float | None
    e2e_s: float
    stream: bool
    tenant: str = ""
    key_id: str = ""
    client_request_id: str = ""
    router_score: float | None = None
    tags: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    deadline_ms: int | None = None
    max_tokens: int = 0
    prices: list[int] = field(default_factory=list)   # [input, cached_input, output] per 1M tokens, as charged
    baseline_engine: str = ""
    baseline_cost_micros: int = 0  # the same tokens at the baseline (large) engine's prices
    key_name: str = ""
    requested_max_tokens: int | None = None
    engine_state: dict[str, dict[str, Any]] | None = None
    policy_version: int = 0
    context_dropped_tokens: int = 0
    # For the what-if replay to bill as the gateway did (tokenyard/policies/simulate.py):
    routed_prompt_tokens: int = 0  # the prompt count the policy saw (a multi-prompt batch: its longest prompt)
    batch: bool = False            # a Batch API line ...
    price_percent: int = 100       # ... charged this percent of the prices
    choice_completion_tokens: list[int] = field(default_factory=list)   # per choice, when n x prompts > 1
    # Upstream engines (type: openai): counts the gateway estimated because the upstream reported no
    # usage; the deployment that answered (host:port); the attempts the request took.
    usage_estimated: bool = False
    upstream_deployment: str = ""
    upstream_attempts: int = 0
    api: str = "chat"              # the client API the request came in by: chat, messages, responses
    lora: str = ""                 # the LoRA adapter that served it (model ENGINE:ADAPTER); "": the base model

    def to_dict(self) -> dict[str, Any]:
        """asdict's result without its recursive deep copy (a third of a millisecond per request):
        the containers are copied one level, which is all a record holds (engine_state: a level more)."""
        out = {name: getattr(self, name) for name in _FIELD_NAMES}
        out["tags"] = dict(self.tags)
        out["prices"] = list(self.prices)
        out["choice_completion_tokens"] = list(self.choice_completion_tokens)
        if self.engine_state is not None:
            out["engine_state"] = {k: dict(v) for k, v in self.engine_state.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "UsageRecord":
        """Inverse of to_dict; unknown keys (from a newer gateway) are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


_FIELD_NAMES = tuple(f.name for f in fields(UsageRecord))


def _defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(UsageRecord):
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


_DEFAULTS = _defaults()


def compact(rec: dict[str, Any]) -> dict[str, Any]:
    """A record dict without the fields that hold their default: what the request stream stores,
    one entry per request (most optional fields are at their default, and the full dict is twice
    the size). `expand` is the inverse."""
    return {k: v for k, v in rec.items() if k not in _DEFAULTS or v != _DEFAULTS[k]
            or type(v) is not type(_DEFAULTS[k])}


def expand(rec: dict[str, Any]) -> dict[str, Any]:
    """A stored record with every field `compact` left out set to its default again."""
    out = {f.name: rec[f.name] if f.name in rec else _copy(_DEFAULTS[f.name]) for f in fields(UsageRecord)
           if f.name in rec or f.name in _DEFAULTS}
    out.update((k, v) for k, v in rec.items() if k not in out)     # a newer gateway's fields, kept
    return out


def _copy(v: Any) -> Any:
    return list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v


UsageSink = Callable[[UsageRecord], None]


class RecentUsage:
    """The in-memory sink: the last `size` records, newest last."""

    def __init__(self, size: int = 1000) -> None:
        self.records: deque[UsageRecord] = deque(maxlen=size)

    def __call__(self, record: UsageRecord) -> None:
        self.records.append(record)

    def find(self, request_id: str) -> UsageRecord | None:
        for rec in reversed(self.records):
            if rec.request_id == request_id or rec.client_request_id == request_id:
                return rec
        return None


class FanOut:
    """Hands each record to several sinks; one failing sink never stops the others."""

    def __init__(self, *sinks: UsageSink) -> None:
        self.sinks = [s for s in sinks if s is not None]

    def __call__(self, record: UsageRecord) -> None:
        for sink in self.sinks:
            try:
                sink(record)
            except Exception:  # noqa: BLE001 - a broken sink must not fail the request's end
                log.exception("usage sink %r failed", sink)
