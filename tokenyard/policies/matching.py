"""Does a rule match a request? The request's features, and the first-match-wins rule scan."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone

from .schema import AUTO, Match, Policy, Rule


@dataclass(slots=True, frozen=True, kw_only=True)
class RequestFeatures:
    """What the policy may look at for one request: counts and labels, never prompt text.

    requested_model is "auto" or an engine name; prompt_tokens is the gateway's one count;
    max_tokens is what the client asked for (None: the gateway's default applies); tags are the
    request's metadata (string values); time is when it arrived (naive means UTC);
    deadline_ms is how long the client will wait for the first token (None: no deadline).
    """

    tenant: str
    time: datetime
    requested_model: str = AUTO
    prompt_tokens: int = 0
    max_tokens: int | None = None
    key_name: str | None = None
    key_id: str | None = None
    tags: Mapping[str, str] = field(default_factory=dict)
    deadline_ms: float | None = None


def utc_minute(t: datetime) -> int:
    """Minutes after midnight UTC; a naive datetime is taken as UTC already."""
    if t.tzinfo is not None:
        t = t.astimezone(timezone.utc)
    return t.hour * 60 + t.minute


def matches(m: Match, req: RequestFeatures) -> bool:
    if m.tenants and req.tenant not in m.tenants:
        return False
    if m.keys and req.key_name not in m.keys and req.key_id not in m.keys:
        return False
    if m.models and req.requested_model not in m.models:
        return False
    if m.prompt_tokens is not None and not m.prompt_tokens.contains(req.prompt_tokens):
        return False
    for tag, allowed in m.tags:
        if tag not in req.tags or str(req.tags[tag]) not in allowed:
            return False
    if m.time_utc:
        minute = utc_minute(req.time)
        if not any(r.contains(minute) for r in m.time_utc):
            return False
    return True


def first_match(policy: Policy, req: RequestFeatures) -> tuple[int, Rule] | None:
    """The first rule (in document order) whose match holds; rule order is the priority."""
    for index, rule in enumerate(policy.rules):
        if matches(rule.match, req):
            return index, rule
    return None
