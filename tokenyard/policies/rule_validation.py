"""Reading the `rules` section: ordered rules, each a match (conditions) and an action.

Split from validation.py, which reads the rest of the document; problems go to the same
Reader, so positions, key paths and allowed values look the same everywhere.
"""
from __future__ import annotations

import re
from typing import Any

from yaml.nodes import Node, SequenceNode

from .schema import AUTO, FALLBACK_ON, PRIORITIES, TRIM_MODES, Action, ContextLimit, Fallback, Match, Rule, TimeRange, TokenRange
from .yaml_nodes import Reader

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")           # engines, rules, classes (as deployment.py)
MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(?::[A-Za-z0-9][A-Za-z0-9._-]{0,63})?$")   # ENGINE[:ADAPTER]
TENANT = re.compile(r"^(\*|[A-Za-z0-9][A-Za-z0-9._:@-]{0,127})$")
_TIME = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-(?:([01][0-9]|2[0-3]):([0-5][0-9])|(24):(00))$")
MAX_TOKENS_LIMIT = 10_000_000

RULE_KEYS = ("name", "match", "action")
MATCH_KEYS = ("tenants", "keys", "models", "prompt_tokens", "tags", "time_utc")
ACTION_KEYS = ("pin", "router", "deny", "priority", "max_tokens", "degrade", "context", "quality_target",
               "fallback")
FALLBACK_KEYS = ("engines", "on")
CONTEXT_KEYS = ("max_prompt_tokens", "trim")
RANGE_KEYS = ("min", "max")


def read_rules(r: Reader, node: Node, priced: tuple[str, ...]) -> tuple[Rule, ...] | None:
    """The rules in document order (order is priority); priced: the engine names a pin may use."""
    items = r.sequence(node, "rules")
    if items is None:
        return None
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        path = f"rules[{i}]"
        m = r.mapping(item, path, RULE_KEYS, required=("name", "action"))
        if m is None:
            continue
        name = r.string(m["name"], f"{path}.name", pattern=NAME,
                        what="a rule name (letters, digits, '.', '_' or '-', at most 64)") if "name" in m else None
        if name is not None:
            if name in seen:
                r.problem(m["name"], f"{path}.name", f"duplicate rule name (also rules[{seen[name]}])")
            seen[name] = i
        match = _match(r, m["match"], f"{path}.match", priced) if "match" in m and not r.is_null(m["match"]) \
            else Match()
        action = _action(r, m["action"], f"{path}.action", priced) if "action" in m else None
        if name is not None and match is not None and action is not None:
            rules.append(Rule(name=name, match=match, action=action))
    return tuple(rules)


def model_names(r: Reader, node: Node, path: str, priced: tuple[str, ...], with_auto: bool,
                one: bool = False) -> tuple[str, ...] | None:
    """Engine names, or ENGINE:ADAPTER (one of a priced engine's LoRA adapters; which adapters an engine
    serves is the deployment's business, and they load at run time, so only the form is checked here)."""
    allowed = (AUTO, *priced) if with_auto else priced
    got = r.strings(node, path, pattern=MODEL, what="an engine name or ENGINE:ADAPTER") if not one else (
        None if (v := r.string(node, path, pattern=MODEL, what="an engine name or ENGINE:ADAPTER")) is None else (v,))
    if got is None:
        return None
    for name in got:
        engine, sep, _ = name.partition(":")
        if (name not in allowed and not sep) or (sep and engine not in priced):
            r.problem(node, path, f"must name a priced engine (or ENGINE:ADAPTER of one), got {name!r}", allowed)
            return None
    return got


def _match(r: Reader, node: Node, path: str, priced: tuple[str, ...]) -> Match | None:
    m = r.mapping(node, path, MATCH_KEYS)
    if m is None:
        return None
    ok = True

    def many(key: str, **kw: Any) -> tuple[str, ...]:
        nonlocal ok
        if key not in m:
            return ()
        got = r.strings(m[key], f"{path}.{key}", **kw)
        ok = ok and got is not None
        return got or ()

    tenants = many("tenants", pattern=TENANT, what="a tenant name")
    keys = many("keys")
    models: tuple[str, ...] = ()
    if "models" in m:
        named = model_names(r, m["models"], f"{path}.models", priced, with_auto=True)
        ok = ok and named is not None
        models = named or ()
    tokens = None
    if "prompt_tokens" in m:
        tokens = _range(r, m["prompt_tokens"], f"{path}.prompt_tokens")
        ok = ok and tokens is not None
    tags: list[tuple[str, tuple[str, ...]]] = []
    if "tags" in m:
        tm = r.mapping(m["tags"], f"{path}.tags")
        if tm is None:
            ok = False
        for tag, value in (tm or {}).items():
            values = r.strings(value, f"{path}.tags.{tag}")
            if values is None:
                ok = False
            else:
                tags.append((tag, values))
    times: list[TimeRange] = []
    if "time_utc" in m:
        tnode = m["time_utc"]
        if isinstance(tnode, SequenceNode):
            pairs = [(n, f"{path}.time_utc[{i}]") for i, n in enumerate(tnode.value)]
            if not pairs:
                r.problem(tnode, f"{path}.time_utc", "must not be an empty list")
                ok = False
        else:
            pairs = [(tnode, f"{path}.time_utc")]
        for n, p in pairs:
            text = r.string(n, p, pattern=_TIME, what="a UTC time range HH:MM-HH:MM (e.g. 22:00-06:00)")
            if text is None:
                ok = False
                continue
            start, end = _minutes(text)
            if start == end:
                r.problem(n, p, f"empty time range {text!r}: start must differ from end")
                ok = False
            else:
                times.append(TimeRange(start, end))
    if not ok:
        return None
    return Match(tenants=tenants, keys=keys, models=models, prompt_tokens=tokens,
                 tags=tuple(sorted(tags)), time_utc=tuple(times))


def _minutes(text: str) -> tuple[int, int]:
    g = _TIME.match(text)
    assert g is not None
    end = 24 * 60 if g[5] else int(g[3]) * 60 + int(g[4])     # 24:00 ends at midnight
    return int(g[1]) * 60 + int(g[2]), end


def _range(r: Reader, node: Node, path: str) -> TokenRange | None:
    m = r.mapping(node, path, RANGE_KEYS)
    if m is None:
        return None
    if not m:
        r.problem(node, path, "must set min, max or both", RANGE_KEYS)
        return None
    low = r.integer(m["min"], f"{path}.min", 0) if "min" in m else None
    high = r.integer(m["max"], f"{path}.max", 0) if "max" in m else None
    if ("min" in m and low is None) or ("max" in m and high is None):
        return None
    if low is not None and high is not None and low > high:
        r.problem(m["max"], f"{path}.max", f"must be >= min ({low}), got {high}")
        return None
    return TokenRange(low, high)


def _action(r: Reader, node: Node, path: str, priced: tuple[str, ...]) -> Action | None:
    m = r.mapping(node, path, ACTION_KEYS)
    if m is None:
        return None
    if not m:
        r.problem(node, path, "must set at least one of the keys", ACTION_KEYS)
        return None
    n = len(r.problems)
    pins = model_names(r, m["pin"], f"{path}.pin", priced, with_auto=False, one=True) if "pin" in m else None
    pin = pins[0] if pins else None
    router = bool(r.boolean(m["router"], f"{path}.router")) if "router" in m else False
    deny = r.string(m["deny"], f"{path}.deny", what="a message") if "deny" in m else None
    if deny is not None and not deny.strip():
        r.problem(m["deny"], f"{path}.deny", "the deny message must not be empty")
    priority = r.string(m["priority"], f"{path}.priority", PRIORITIES) if "priority" in m else None
    cap = r.integer(m["max_tokens"], f"{path}.max_tokens", 1, MAX_TOKENS_LIMIT) if "max_tokens" in m else None
    degrade = r.boolean(m["degrade"], f"{path}.degrade") if "degrade" in m else None
    context = read_context_limit(r, m["context"], f"{path}.context") if "context" in m else None
    target = r.number(m["quality_target"], f"{path}.quality_target", 0.0, 1.0) if "quality_target" in m else None
    fallback = read_fallback(r, m["fallback"], f"{path}.fallback", priced) if "fallback" in m else None
    if "quality_target" in m and ("pin" in m or "deny" in m):
        r.problem(m["quality_target"], f"{path}.quality_target", "a quality target is for the router: not with "
                  "pin or deny")
    routes = [k for k in ("pin", "router", "deny") if k in m]
    if len(routes) > 1:
        r.problem(m[routes[1]], f"{path}.{routes[1]}",
                  f"a rule routes one way: set only one of pin, router, deny (found {', '.join(routes)})")
    if len(r.problems) != n:
        return None
    return Action(pin=pin, router=router, deny=deny, priority=priority, max_tokens=cap, degrade=degrade,
                  context=context, quality_target=target, fallback=fallback)


def read_fallback(r: Reader, node: Node, path: str, priced: tuple[str, ...]) -> Fallback | None:
    """{engines: [a, b], on: [error, rate_limit, context_length]} (a tenant's or a rule's); a bare
    list of engines means every condition."""
    if isinstance(node, SequenceNode):
        engines = r.strings(node, path, allowed=priced)
        return Fallback(engines=engines) if engines is not None else None
    m = r.mapping(node, path, FALLBACK_KEYS, required=("engines",))
    if m is None or "engines" not in m:
        return None
    engines = r.strings(m["engines"], f"{path}.engines", allowed=priced)
    on = r.strings(m["on"], f"{path}.on", allowed=FALLBACK_ON) if "on" in m else FALLBACK_ON
    if engines is None or on is None:
        return None
    if len(set(engines)) != len(engines):
        r.problem(m["engines"], f"{path}.engines", "lists an engine twice")
        return None
    return Fallback(engines=engines, on=tuple(dict.fromkeys(on)))


def read_context_limit(r: Reader, node: Node, path: str) -> ContextLimit | None:
    """{max_prompt_tokens: N, trim: keep_system_and_latest | none} (a tenant's or a rule's)."""
    m = r.mapping(node, path, CONTEXT_KEYS, required=("max_prompt_tokens",))
    if m is None or "max_prompt_tokens" not in m:
        return None
    n = len(r.problems)
    limit = r.integer(m["max_prompt_tokens"], f"{path}.max_prompt_tokens", 1, MAX_TOKENS_LIMIT)
    trim = r.string(m["trim"], f"{path}.trim", TRIM_MODES) if "trim" in m else TRIM_MODES[1]
    if len(r.problems) != n or limit is None or trim is None:
        return None
    return ContextLimit(max_prompt_tokens=limit, trim=trim)
