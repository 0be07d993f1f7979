"""Policy documents in, a valid Policy out, or a PolicyError listing every problem.

    load_policy(text)          YAML text (an editor's file, the PUT body, the stored version)
    load_policy_file(path)
    build_policy(mapping)      plain Python data (a JSON body already parsed); no line numbers
    check_policy(text)         the problems without raising (the operator page's "validate")

Unknown keys are errors, not warnings: a misspelt `per_mnth` silently ignored would be a budget
nobody enforces. Each problem carries line/column, the key path and, where there is a closed
set, the allowed values. Cross references (rule pins, engine roles, rate classes) are checked
against the same document, so a policy is valid or not on its own.
"""
from __future__ import annotations

import io
import re
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .adapter_access import PATTERN as ADAPTER_PATTERN
from .errors import PolicyError, Problem
from .rule_validation import NAME, TENANT, read_context_limit, read_fallback, read_rules
from .schema import (
    AT_LIMIT,
    DEFAULT_BATCH_PRICE_PERCENT,
    DEFAULT_TENANT,
    PRIORITIES,
    ROLES,
    SCHEMA_VERSION,
    Budget,
    EngineRoles,
    Overflow,
    Policy,
    Prices,
    RateClass,
    RouterSettings,
    TenantPolicy,
)
from .yaml_nodes import Reader, all_read, all_read_items, check_text, compose

TOP_KEYS = ("version", "description", "engines", "prices", "router", "default_priority", "rules",
            "rate_classes", "tenants", "overflow", "batch_price_percent")
PRICE_KEYS = ("input", "cached_input", "output")
ROUTER_KEYS = ("threshold", "target_large_share", "without_score", "quality_target", "cost_cap", "artifact", "shadow")
ARTIFACT_REF = re.compile(r"^sha256:[0-9a-f]{64}$")     # a published router artifact's checksum
ENGINE_KEYS = (*ROLES, "tiers")
RATE_KEYS = ("requests_per_min", "tokens_per_min", "burst")
TENANT_KEYS = ("rate_class", "budget", "key_budgets", "tag_budgets", "weight", "context", "fallback", "adapters")
MAX_WEIGHT = 1000
BUDGET_KEYS = ("per_day", "per_month", "at_limit")
OVERFLOW_KEYS = ("enabled", "degrade", "upgrade", "degrade_pinned", "shed")


def load_policy(text: str) -> Policy:
    reader = Reader()
    root = compose(text, reader)
    policy = _policy(reader, root) if root is not None else None
    if reader.problems or policy is None:
        raise PolicyError(_in_document_order(reader.problems))
    return policy


def _in_document_order(problems: list[Problem]) -> list[Problem]:
    # Sections are read in dependency order (prices before rules); report in text order.
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0, p.column or 0))


def load_policy_file(path: str | Path) -> Policy:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError([Problem("", f"cannot read policy file {str(path)!r}: {exc}")]) from None
    return load_policy(text)


def check_policy(text: str) -> list[Problem]:
    try:
        load_policy(text)
    except PolicyError as exc:
        return exc.problems
    return []


def build_policy(data: Mapping[str, Any]) -> Policy:
    """Validate already-parsed data (e.g. a JSON body). Decimal and str money stay exact; a
    float is read through its shortest repr (0.05 -> "0.05"), so prefer strings."""
    dumper = yaml.SafeDumper(io.StringIO())
    dumper.add_representer(Decimal, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", str(v)))
    try:
        root = dumper.represent_data(data)
    except yaml.representer.RepresenterError as exc:
        raise PolicyError([Problem("", f"cannot represent the data: {exc}")]) from None
    except RecursionError:
        raise PolicyError([Problem("", "the document is nested too deeply")]) from None
    reader = Reader()
    check_text(root, reader)
    if reader.problems:
        raise PolicyError(reader.problems)
    policy = _policy(reader, root)
    if reader.problems or policy is None:
        raise PolicyError(_in_document_order(reader.problems))
    return policy


def _policy(r: Reader, root: Node) -> Policy | None:
    top = r.mapping(root, "", TOP_KEYS, required=("version", "engines", "prices"))
    if top is None:
        return None
    if "version" in top:
        v = r.integer(top["version"], "version")
        if v is not None and v != SCHEMA_VERSION:
            r.problem(top["version"], "version", f"unsupported policy format version {v}", (str(SCHEMA_VERSION),))
    description = ""
    if "description" in top and not r.is_null(top["description"]):
        description = r.string(top["description"], "description") or ""
    prices = _prices(r, top["prices"]) if "prices" in top else {}
    # Engines are "declared" by having a prices entry, valid or not: a bad price is reported
    # once, not again at every rule or role that names the engine.
    priced = _declared(top["prices"]) if "prices" in top else ()
    roles = _roles(r, top["engines"], priced) if "engines" in top else None
    default_priority = "interactive"
    if "default_priority" in top:
        default_priority = r.string(top["default_priority"], "default_priority", PRIORITIES) or default_priority
    router = _router(r, top["router"]) if "router" in top else RouterSettings()
    rules = read_rules(r, top["rules"], priced) if "rules" in top and not r.is_null(top["rules"]) else ()
    classes = (_rate_classes(r, top["rate_classes"])
               if "rate_classes" in top and not r.is_null(top["rate_classes"]) else {})
    tenants = (_tenants(r, top["tenants"], tuple(classes or {}), priced)
               if "tenants" in top and not r.is_null(top["tenants"]) else {})
    overflow = _overflow(r, top["overflow"]) if "overflow" in top else Overflow()
    batch_percent: int | None = DEFAULT_BATCH_PRICE_PERCENT
    if "batch_price_percent" in top:
        batch_percent = r.integer(top["batch_price_percent"], "batch_price_percent", 0, 100)
    if r.problems or roles is None or prices is None or router is None or rules is None \
            or classes is None or tenants is None or overflow is None or batch_percent is None:
        return None
    return Policy(engines=roles, prices=prices, version=SCHEMA_VERSION, description=description,
                  default_priority=default_priority, router=router, rules=rules, rate_classes=classes,
                  tenants=tenants, overflow=overflow, batch_price_percent=batch_percent)


def _declared(node: Node) -> tuple[str, ...]:
    if not isinstance(node, MappingNode):
        return ()
    return tuple(k.value for k, _ in node.value if isinstance(k, ScalarNode) and NAME.match(k.value))


def _prices(r: Reader, node: Node) -> dict[str, Prices] | None:
    m = r.mapping(node, "prices")
    if m is None:
        return None
    if not m:
        r.problem(node, "prices", "must price at least one engine")
    out: dict[str, Prices] = {}
    for engine, value in m.items():
        path = f"prices.{engine}"
        if not NAME.match(engine):
            r.problem(value, path, "engine names are letters, digits, '.', '_' or '-' (at most 64)")
            continue
        fields = r.mapping(value, path, PRICE_KEYS, required=PRICE_KEYS)
        if fields is None:
            continue
        amounts = all_read({k: r.money(fields[k], f"{path}.{k}") for k in PRICE_KEYS if k in fields})
        if amounts is not None and len(amounts) == len(PRICE_KEYS):
            out[engine] = Prices(**amounts)
    return out


def _roles(r: Reader, node: Node, priced: tuple[str, ...]) -> EngineRoles | None:
    m = r.mapping(node, "engines", ENGINE_KEYS, required=ROLES)
    if m is None:
        return None
    names = all_read({role: r.string(m[role], f"engines.{role}", priced) for role in ROLES if role in m})
    if names is None or len(names) != 2:
        return None
    if names["small"] == names["large"]:
        r.problem(m["large"], "engines.large", "must differ from engines.small")
        return None
    tiers: tuple[str, ...] = ()
    if "tiers" in m and not r.is_null(m["tiers"]):
        items = r.sequence(m["tiers"], "engines.tiers")
        if items is None:
            return None
        found = all_read_items([r.string(item, f"engines.tiers[{i}]", priced) for i, item in enumerate(items)])
        if found is None:
            return None
        if len(set(found)) != len(found) or len(found) < 2 or found[0] != names["small"] \
                or found[-1] != names["large"]:
            r.problem(m["tiers"], "engines.tiers", "must list distinct engines in cost order, engines.small first "
                      "and engines.large last")
            return None
        tiers = found
    return EngineRoles(small=names["small"], large=names["large"], tiers=tiers)


def _router(r: Reader, node: Node) -> RouterSettings | None:
    if r.is_null(node):
        return RouterSettings()
    m = r.mapping(node, "router", ROUTER_KEYS)
    if m is None:
        return None
    threshold = share = None
    if "threshold" in m and not r.is_null(m["threshold"]):
        threshold = r.number(m["threshold"], "router.threshold", 0.0, 1.0)
    if "target_large_share" in m and not r.is_null(m["target_large_share"]):
        share = r.number(m["target_large_share"], "router.target_large_share", 0.0, 1.0)
    if threshold is not None and share is not None:
        r.problem(m["target_large_share"], "router.target_large_share",
                  "set router.threshold or router.target_large_share, not both")
        return None
    without = "large"
    if "without_score" in m:
        without = r.string(m["without_score"], "router.without_score", ROLES) or without
    target = cap = None
    if "quality_target" in m and not r.is_null(m["quality_target"]):
        target = r.number(m["quality_target"], "router.quality_target", 0.0, 1.0)
    if "cost_cap" in m and not r.is_null(m["cost_cap"]):
        cap = r.number(m["cost_cap"], "router.cost_cap", 0.0, None)
    if target is not None and cap is not None:
        r.problem(m["cost_cap"], "router.cost_cap", "set router.quality_target or router.cost_cap, not both")
        return None
    refs: dict[str, str | None] = {"artifact": None, "shadow": None}
    for key in refs:
        if key in m and not r.is_null(m[key]):
            refs[key] = r.string(m[key], f"router.{key}", pattern=ARTIFACT_REF,
                                 what="a published router artifact's checksum, sha256:<64 hex digits>")
    return RouterSettings(threshold=threshold, target_large_share=share, without_score=without,
                          quality_target=target, cost_cap=cap, artifact=refs["artifact"], shadow=refs["shadow"])


def _rate_classes(r: Reader, node: Node) -> dict[str, RateClass] | None:
    m = r.mapping(node, "rate_classes")
    if m is None:
        return None
    out: dict[str, RateClass] = {}
    for name, value in m.items():
        path = f"rate_classes.{name}"
        if not NAME.match(name):
            r.problem(value, path, "class names are letters, digits, '.', '_' or '-' (at most 64)")
            continue
        f = r.mapping(value, path, RATE_KEYS, required=("requests_per_min", "tokens_per_min"))
        if f is None:
            continue
        rpm = r.integer(f["requests_per_min"], f"{path}.requests_per_min", 1) if "requests_per_min" in f else None
        tpm = r.integer(f["tokens_per_min"], f"{path}.tokens_per_min", 1) if "tokens_per_min" in f else None
        burst = r.integer(f["burst"], f"{path}.burst", 1) if "burst" in f else rpm
        if rpm is not None and tpm is not None and burst is not None:
            out[name] = RateClass(requests_per_min=rpm, tokens_per_min=tpm, burst=burst)
    return out


def _tenants(r: Reader, node: Node, classes: tuple[str, ...], priced: tuple[str, ...]) -> dict[str, TenantPolicy] | None:
    m = r.mapping(node, "tenants")
    if m is None:
        return None
    out: dict[str, TenantPolicy] = {}
    for name, value in m.items():
        path = f"tenants.{name}"
        if not TENANT.match(name):
            r.problem(value, path, f"tenant names are letters, digits, '.', '_', ':', '@' or '-', "
                                   f"or {DEFAULT_TENANT!r} for every other tenant")
            continue
        f = r.mapping(value, path, TENANT_KEYS)
        if f is None:
            continue
        n = len(r.problems)
        rate_class = None
        if "rate_class" in f and not r.is_null(f["rate_class"]):
            rate_class = r.string(f["rate_class"], f"{path}.rate_class", classes or ("(no rate_classes defined)",))
        budget = _budget(r, f["budget"], f"{path}.budget") if "budget" in f and not r.is_null(f["budget"]) else None
        keys = _key_budgets(r, f["key_budgets"], f"{path}.key_budgets") \
            if "key_budgets" in f and not r.is_null(f["key_budgets"]) else {}
        tags = _tag_budgets(r, f["tag_budgets"], f"{path}.tag_budgets") \
            if "tag_budgets" in f and not r.is_null(f["tag_budgets"]) else {}
        weight = r.integer(f["weight"], f"{path}.weight", 1, MAX_WEIGHT) if "weight" in f else 1
        context = read_context_limit(r, f["context"], f"{path}.context") \
            if "context" in f and not r.is_null(f["context"]) else None
        fallback = read_fallback(r, f["fallback"], f"{path}.fallback", priced) \
            if "fallback" in f and not r.is_null(f["fallback"]) else None
        adapters = _adapters(r, f["adapters"], f"{path}.adapters", priced) if "adapters" in f else None
        if len(r.problems) == n and weight is not None:
            out[name] = TenantPolicy(rate_class=rate_class, budget=budget, key_budgets=keys or {},
                                     tag_budgets=tags or {}, weight=weight, context=context, fallback=fallback,
                                     adapters=adapters)
    return out


def _adapters(r: Reader, node: Node, path: str, priced: tuple[str, ...]) -> tuple[str, ...] | None:
    """A tenant's LoRA allow list: '*', 'ENGINE:*' or 'ENGINE:ADAPTER' of a priced engine; [] allows none."""
    if isinstance(node, SequenceNode) and not node.value:
        return ()
    items = r.strings(node, path, pattern=ADAPTER_PATTERN, what="an adapter pattern: '*', 'ENGINE:*' or 'ENGINE:ADAPTER'")
    if items is None:
        return None
    for item in items:
        engine = item.partition(":")[0]
        if item != "*" and engine not in priced:
            r.problem(node, path, f"{item!r} names engine {engine!r}, which prices does not list", priced)
            return None
    return tuple(dict.fromkeys(items))


def _key_budgets(r: Reader, node: Node, path: str) -> dict[str, Budget] | None:
    """{key id | key name | "*": budget}: each matching key of the tenant on its own."""
    m = r.mapping(node, path)
    if m is None:
        return None
    out: dict[str, Budget] = {}
    for key, value in m.items():
        if not key or len(key) > 128 or key != key.strip():
            r.problem(value, f"{path}.{key}", "a key id, a key name (1-128 characters, no surrounding spaces) "
                                              "or '*' for every key")
            continue
        budget = _budget(r, value, f"{path}.{key}")
        if budget is not None:
            out[key] = budget
    return out


def _tag_budgets(r: Reader, node: Node, path: str) -> dict[str, dict[str, Budget]] | None:
    """{tag NAME: {value | "*": budget}}: each matching value of the request's metadata tag on its own."""
    m = r.mapping(node, path)
    if m is None:
        return None
    out: dict[str, dict[str, Budget]] = {}
    for tag, values in m.items():
        tpath = f"{path}.{tag}"
        if not tag or len(tag) > 64 or "|" in tag:
            r.problem(values, tpath, "tag names are 1-64 characters without '|'")
            continue
        vm = r.mapping(values, tpath)
        if vm is None:
            continue
        if not vm:
            r.problem(values, tpath, "must give at least one value (or '*' for every value) with its budget")
            continue
        budgets: dict[str, Budget] = {}
        for value, bnode in vm.items():
            if not value or len(value) > 256:
                r.problem(bnode, f"{tpath}.{value}", "a tag value of 1-256 characters, or '*' for every value")
                continue
            budget = _budget(r, bnode, f"{tpath}.{value}")
            if budget is not None:
                budgets[value] = budget
        out[tag] = budgets
    return out


def _budget(r: Reader, node: Node, path: str) -> Budget | None:
    m = r.mapping(node, path, BUDGET_KEYS)
    if m is None:
        return None
    if "per_day" not in m and "per_month" not in m:
        r.problem(node, path, "must set per_day, per_month or both", ("per_day", "per_month"))
        return None
    n = len(r.problems)
    day = r.money(m["per_day"], f"{path}.per_day") if "per_day" in m and not r.is_null(m["per_day"]) else None
    month = r.money(m["per_month"], f"{path}.per_month") \
        if "per_month" in m and not r.is_null(m["per_month"]) else None
    at_limit = r.string(m["at_limit"], f"{path}.at_limit", AT_LIMIT) if "at_limit" in m else "deny"
    if len(r.problems) != n or at_limit is None:
        return None
    if day is None and month is None:
        r.problem(node, path, "must set per_day, per_month or both", ("per_day", "per_month"))
        return None
    return Budget(per_day=day, per_month=month, at_limit=at_limit)


def _overflow(r: Reader, node: Node) -> Overflow | None:
    if r.is_null(node):
        return Overflow()
    m = r.mapping(node, "overflow", OVERFLOW_KEYS)
    if m is None:
        return None
    values = all_read({k: r.boolean(v, f"overflow.{k}") for k, v in m.items()})
    if values is None:
        return None
    return Overflow(**values)
