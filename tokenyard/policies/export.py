"""A Policy out again: plain data, YAML for people, canonical JSON and its hash for versions,
and a readable diff between two policies.

Two renderings of one tree:
  - policy_to_yaml: what an operator exports and edits. Money as exact decimal currency (0.05),
    keys in schema order, every default written out so the file shows what is in force.
  - canonical_json: what a version is identified by. Money as integer micro-units, keys
    sorted, no whitespace, defaults explicit. Two documents that mean the same policy (keys
    reordered, comments changed, a default written or left out, 0.050 vs 0.05) have the same
    canonical JSON and hash; any change of meaning changes it. Rule order is meaning.
Both come from the validated Policy, never from the source text, which is why they agree.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import yaml

from .cost import format_money
from .line_diff import unified_diff
from .schema import (
    DEFAULT_BATCH_PRICE_PERCENT,
    Action,
    Budget,
    ContextLimit,
    Fallback,
    Match,
    Policy,
    Rule,
    TenantPolicy,
    TimeRange,
)


class _Money(str):
    """Decimal currency text that YAML writes as a plain number (0.05, not '0.05')."""


class _Dumper(yaml.SafeDumper):
    pass


def _represent_money(dumper: yaml.SafeDumper, value: _Money) -> yaml.Node:
    tag = "tag:yaml.org,2002:float" if "." in value else "tag:yaml.org,2002:int"
    return dumper.represent_scalar(tag, str(value))


_Dumper.add_representer(_Money, _represent_money)


def policy_to_dict(policy: Policy, money: str = "decimal") -> dict[str, Any]:
    """Plain data for a policy. money="decimal": currency strings ("0.05", what the YAML holds);
    money="micros": integer micro-units (the canonical form)."""
    if money not in ("decimal", "micros"):
        raise ValueError("money must be 'decimal' or 'micros'")
    cash: Callable[[int | None], Any] = (lambda m: None if m is None else _Money(format_money(m))) \
        if money == "decimal" else (lambda m: m)
    out: dict[str, Any] = {
        "version": policy.version,
        "description": policy.description,
        "engines": {"small": policy.engines.small, "large": policy.engines.large},
        "prices": {name: {"input": cash(p.input), "cached_input": cash(p.cached_input), "output": cash(p.output)}
                   for name, p in sorted(policy.prices.items())},
        "router": {"threshold": policy.router.threshold, "target_large_share": policy.router.target_large_share,
                   "without_score": policy.router.without_score},
        "default_priority": policy.default_priority,
        "rules": [_rule(rule) for rule in policy.rules],
        "rate_classes": {name: {"requests_per_min": c.requests_per_min, "tokens_per_min": c.tokens_per_min,
                                "burst": c.burst} for name, c in sorted(policy.rate_classes.items())},
        "tenants": {name: _tenant(t, cash) for name, t in sorted(policy.tenants.items())},
        "overflow": {"enabled": policy.overflow.enabled, "degrade": policy.overflow.degrade,
                     "upgrade": policy.overflow.upgrade, "degrade_pinned": policy.overflow.degrade_pinned,
                     "shed": policy.overflow.shed},
    }
    # Written only when not the default, so the canonical form (and hash) of older policies stays.
    if policy.engines.tiers:
        out["engines"]["tiers"] = list(policy.engines.tiers)
    for key in ("quality_target", "cost_cap", "artifact", "shadow"):
        if getattr(policy.router, key) is not None:
            out["router"][key] = getattr(policy.router, key)
    if policy.batch_price_percent != DEFAULT_BATCH_PRICE_PERCENT:
        out["batch_price_percent"] = policy.batch_price_percent
    return out


def _rule(rule: Rule) -> dict[str, Any]:
    return {"name": rule.name, "match": _match(rule.match), "action": _action(rule.action)}


def _match(m: Match) -> dict[str, Any]:
    # Absent conditions stay absent: absence is the only way to say "any", so this is canonical.
    out: dict[str, Any] = {}
    if m.tenants:
        out["tenants"] = list(m.tenants)
    if m.keys:
        out["keys"] = list(m.keys)
    if m.models:
        out["models"] = list(m.models)
    if m.prompt_tokens is not None:
        out["prompt_tokens"] = {k: v for k, v in (("min", m.prompt_tokens.min), ("max", m.prompt_tokens.max))
                                if v is not None}
    if m.tags:
        out["tags"] = {tag: list(values) for tag, values in m.tags}
    if m.time_utc:
        out["time_utc"] = [_time(t) for t in m.time_utc]
    return out


def _time(t: TimeRange) -> str:
    def hhmm(minute: int) -> str:
        return f"{minute // 60:02d}:{minute % 60:02d}"
    return f"{hhmm(t.start)}-{hhmm(t.end)}"


def _action(a: Action) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if a.pin is not None:
        out["pin"] = a.pin
    if a.router:
        out["router"] = True
    if a.deny is not None:
        out["deny"] = a.deny
    if a.priority is not None:
        out["priority"] = a.priority
    if a.max_tokens is not None:
        out["max_tokens"] = a.max_tokens
    if a.degrade is not None:
        out["degrade"] = a.degrade
    if a.context is not None:
        out["context"] = _context(a.context)
    if a.quality_target is not None:
        out["quality_target"] = a.quality_target
    if a.fallback is not None:
        out["fallback"] = _fallback(a.fallback)
    return out


def _fallback(f: Fallback) -> dict[str, Any]:
    return {"engines": list(f.engines), "on": list(f.on)}


def _context(c: ContextLimit) -> dict[str, Any]:
    return {"max_prompt_tokens": c.max_prompt_tokens, "trim": c.trim}


def _tenant(t: TenantPolicy, cash: Callable[[int | None], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rate_class": t.rate_class, "budget": _budget(t.budget, cash)}
    # Written only when present, so the canonical form (and hash) of a policy without them is as before.
    if t.key_budgets:
        out["key_budgets"] = {k: _budget(b, cash) for k, b in sorted(t.key_budgets.items())}
    if t.tag_budgets:
        out["tag_budgets"] = {tag: {v: _budget(b, cash) for v, b in sorted(values.items())}
                              for tag, values in sorted(t.tag_budgets.items())}
    if t.weight != 1:
        out["weight"] = t.weight
    if t.context is not None:
        out["context"] = _context(t.context)
    if t.fallback is not None:
        out["fallback"] = _fallback(t.fallback)
    if t.adapters is not None:
        out["adapters"] = list(t.adapters)
    return out


def _budget(b: Budget | None, cash: Callable[[int | None], Any]) -> dict[str, Any] | None:
    if b is None:
        return None
    return {"per_day": cash(b.per_day), "per_month": cash(b.per_month), "at_limit": b.at_limit}


def policy_to_yaml(policy: Policy) -> str:
    """The policy as YAML (no comments); load_policy(policy_to_yaml(p)) == p."""
    return yaml.dump(policy_to_dict(policy), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True, width=100)


def canonical_json(policy: Policy) -> str:
    return json.dumps(policy_to_dict(policy, money="micros"), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False, allow_nan=False)


def policy_hash(policy: Policy) -> str:
    """sha256 (hex) of the canonical JSON: the identity of a policy's meaning."""
    return hashlib.sha256(canonical_json(policy).encode("utf-8")).hexdigest()


def diff(old: Policy | None, new: Policy, old_label: str = "current", new_label: str = "proposed") -> str:
    """Unified diff of the two policies' YAML exports ("" when they mean the same). old=None
    diffs against nothing (the first version)."""
    before = policy_to_yaml(old).splitlines(keepends=True) if old is not None else []
    after = policy_to_yaml(new).splitlines(keepends=True)
    return unified_diff(before, after, old_label, new_label)
