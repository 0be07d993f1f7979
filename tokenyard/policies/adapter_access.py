"""Which LoRA adapters a key or a tenant may use: allow lists of `ENGINE:ADAPTER` patterns.

    allows(("demo-large:sql", "demo-small:*"), "demo-large:sql")    # True
    allows(None, "demo-large:sql")                                  # True: no list, every adapter
    allows((), "demo-large:sql")                                    # False: an empty list, no adapter

A pattern is `*` (every adapter of every engine), `ENGINE:*` (every adapter of one engine) or
`ENGINE:ADAPTER` (one). Lists limit adapters only: the base engines a key or tenant may use are the
policy's business (rules that deny). A key's list (`tokenyard keys create --adapters`) and its tenant's
(the policy's `tenants.NAME.adapters`) both apply: a request needs both to allow its adapter.
Pure: no I/O; the gateway (tokenyard/gateway/http/route_plan.py) asks it.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

ANY = "*"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
PATTERN = re.compile(rf"^(?:\*|{_PART}:(?:\*|{_PART}))$")
# an adapter's own name (the part after ENGINE: in a model name); the engine checks the same form
# (tokenyard/engines/lora/adapter_errors.py NAME) when it loads one
ADAPTER_NAME = re.compile(rf"^{_PART}$")


def pattern_problem(item: object) -> str | None:
    """Why `item` is not an allow-list pattern, or None."""
    if not isinstance(item, str) or not PATTERN.match(item):
        return f"{item!r} is not an adapter pattern: '*', 'ENGINE:*' or 'ENGINE:ADAPTER'"
    return None


def parse_patterns(items: Iterable[object]) -> tuple[str, ...]:
    """The patterns in order, each once; ValueError naming the first bad one."""
    out: list[str] = []
    for item in items:
        problem = pattern_problem(item)
        if problem is not None:
            raise ValueError(problem)
        if item not in out:
            out.append(item)      # type: ignore[arg-type]
    return tuple(out)


def allows(patterns: tuple[str, ...] | None, model: str) -> bool:
    """Whether a list allows `model` (ENGINE:ADAPTER); None (no list) allows every adapter."""
    if patterns is None:
        return True
    engine, _, _ = model.partition(":")
    return ANY in patterns or model in patterns or f"{engine}:*" in patterns
