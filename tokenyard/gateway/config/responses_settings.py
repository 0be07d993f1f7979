"""The deployment's `responses:` section: how the Responses API (/v1/responses) keeps stored responses.

    responses: {retention_days, memory_max}

A response created with `store` (true unless the request says false, as OpenAI's) is kept per
tenant for `retention_days` in the gateway's Redis (tokenyard/gateway/store/response_store.py); a
gateway without Redis (no redis_url and no embedded server, i.e. tests) keeps at most `memory_max`
of them in its own memory, lost at restart and not shared between gateways.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokenyard.gateway.config.yaml_fields import mapping, only, typed


@dataclass(slots=True)
class ResponsesSettings:
    retention_days: float = 30.0     # a stored response expires this long after it was created
    memory_max: int = 10_000         # without Redis: responses kept in memory (oldest dropped first)

    @property
    def retention_s(self) -> int:
        return max(1, round(self.retention_days * 86400))


RESPONSES_KEYS = frozenset(f.name for f in fields(ResponsesSettings))


def parse_responses_settings(top: dict[str, Any], error: type[Exception]) -> ResponsesSettings:
    out = ResponsesSettings()
    section = mapping(top.get("responses", {}), "responses", error)
    only(section, "responses.", RESPONSES_KEYS, error)
    days = section.get("retention_days", out.retention_days)
    if not isinstance(days, (int, float)) or isinstance(days, bool) or not 0 < days <= 3650:
        raise error(f"responses.retention_days must be a number in (0, 3650], got {days!r}")
    out.retention_days = float(days)
    out.memory_max = typed(section, "responses.", "memory_max", int, out.memory_max, error)
    if out.memory_max < 1:
        raise error(f"responses.memory_max must be a positive integer, got {out.memory_max}")
    return out
