"""The deployment's `router_learning:` section: whether the gateway keeps routed prompts so that
clients' feedback (POST /v1/feedback) and judges' labels can retrain the router.

    router_learning: {enabled, sample_rate, tenants, max_prompt_chars, retention_days,
                      max_labels_per_tenant, queue_max}

Prompts are the tenant's data: nothing is kept unless the operator sets `enabled: true`. Then a
`sample_rate` share of the requests the two-engine router scores (of the `tenants` listed; null:
every tenant) is kept, prompt text included, for `retention_days` (labels too), at most
`max_prompt_chars` characters (a longer prompt is not kept at all: a cut prompt would train on
features the router never saw), at most `max_labels_per_tenant` labels per tenant (the oldest go
first). A request opts out with metadata `tokenyard_learning: "off"` (routing/traffic_learning.py). docs/router.md has the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from tokenyard.gateway.config.yaml_fields import mapping, only, typed


@dataclass(slots=True)
class LearningSettings:
    enabled: bool = False              # keep routed prompts for feedback (off: POST /v1/feedback finds nothing)
    sample_rate: float = 1.0           # share of scored requests kept, 0..1
    tenants: list[str] | None = None   # tenants whose requests may be kept; None: every tenant
    max_prompt_chars: int = 8000       # longer prompts are not kept
    retention_days: float = 7.0        # samples and labels expire this long after they were written
    max_labels_per_tenant: int = 10_000   # labels kept per tenant (the oldest are dropped past it)
    queue_max: int = 10_000            # samples waiting for the background writer (more are dropped, counted)

    @property
    def retention_s(self) -> int:
        return max(1, round(self.retention_days * 86400))

    def enrolled(self, tenant: str) -> bool:
        return self.enabled and (self.tenants is None or tenant in self.tenants)


LEARNING_KEYS = frozenset(f.name for f in fields(LearningSettings))


def parse_learning_settings(top: dict[str, Any], error: type[Exception]) -> LearningSettings:
    out = LearningSettings()
    section = mapping(top.get("router_learning", {}), "router_learning", error)
    only(section, "router_learning.", LEARNING_KEYS, error)
    out.enabled = typed(section, "router_learning.", "enabled", bool, out.enabled, error)
    rate = section.get("sample_rate", out.sample_rate)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not 0 <= rate <= 1:
        raise error(f"router_learning.sample_rate must be a number in [0, 1], got {rate!r}")
    out.sample_rate = float(rate)
    tenants = section.get("tenants")
    if tenants is not None:
        if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
            raise error("router_learning.tenants must be a list of tenant names, or null for every tenant")
        out.tenants = list(tenants)
    days = section.get("retention_days", out.retention_days)
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not 0 < days <= 3650:
        raise error(f"router_learning.retention_days must be a number in (0, 3650], got {days!r}")
    out.retention_days = float(days)
    for key in ("max_prompt_chars", "max_labels_per_tenant", "queue_max"):
        value = typed(section, "router_learning.", key, int, getattr(out, key), error)
        if value < 1:
            raise error(f"router_learning.{key} must be a positive integer, got {value}")
        setattr(out, key, value)
    return out
