"""Context that fits (issue 30, item 4): a routed prompt too long for the chosen engine's context
moves to another engine of the route whose context holds it (route reason "context"), instead of
the 400 context_length_exceeded the request path gives a prompt no engine holds.

Fits on an engine: prompt tokens (that engine's tokenizer) < its max_model_len, and, when the
request sets max_tokens (or a rule capped it), prompt + max_tokens <= max_model_len: the two
checks of tokenyard/gateway/http/completion_flow.py, which still refuses what fits nowhere.

Only routed requests move: "auto" through the router or the interim rule, a policy's router,
budget downgrade or overflow. A client that names an engine ("pinned") or a rule that pins one
chose that engine; its request keeps it and gets the 400 when too long.

Candidates: the engines the route chooses among (the learned router's, or routing.small and
routing.large), nearest to the chosen one first, a pricier neighbour before a cheaper one, live
engines only.
"""
from __future__ import annotations

from typing import Any, Callable

REASON = "context"


def route_engines(gw: Any) -> list[str]:
    """The engines "auto" routes among, cheapest first."""
    if gw.learned_router is not None:
        return list(gw.learned_router.engines)
    rule = gw.router.rule
    return [rule.small, rule.large] if rule.small is not None and rule.large is not None else []


def nearest_first(engines: list[str], chosen: str) -> list[str]:
    """The other engines by distance from `chosen` in the list, the later (pricier) one first."""
    if chosen not in engines:
        return list(engines)
    i = engines.index(chosen)
    out = []
    for d in range(1, len(engines)):
        out.extend(engines[j] for j in (i + d, i - d) if 0 <= j < len(engines))
    return out


def fits(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> bool:
    return prompt_tokens < max_model_len and (max_tokens is None or prompt_tokens + max_tokens <= max_model_len)


def move_to_fit(gw: Any, plan: Any, counted_with: Any, ids_for: Callable[[str], list[int]],
                prices_for: Callable[[str], Any] | None = None) -> Any:
    """The plan (http/route_plan.py's Plan; `gw` the Gateway: typed loosely, as route_plan.py imports this
    module), moved to an engine whose context holds the prompt when its own does not.
    `ids_for(engine)` tokenises for an engine with another tokenizer; the counting tokenizer's ids
    (plan.prompt_ids) serve every engine that shares it."""
    if plan.reason == "pinned" or plan.reason.startswith("rule:"):
        return plan
    handle = gw.handles[plan.engine]
    own = plan.prompt_ids if handle.tokenizer is counted_with else ids_for(plan.engine)
    if fits(len(own), plan.max_tokens, handle.engine.max_model_len):
        return plan
    for name in nearest_first(route_engines(gw), plan.engine):
        other = gw.handles.get(name)
        if other is None or other.engine.dead:
            continue
        ids = plan.prompt_ids if other.tokenizer is counted_with else ids_for(name)
        if fits(len(ids), plan.max_tokens, other.engine.max_model_len):
            plan.explanation.append(f"the prompt ({len(own)} tokens) does not fit {plan.engine}'s context "
                                    f"({handle.engine.max_model_len} tokens) and fits {name}'s "
                                    f"({other.engine.max_model_len}): moved to {name}")
            plan.engine, plan.reason, plan.prompt_ids = name, REASON, ids
            if prices_for is not None:
                plan.prices = prices_for(name)
            return plan
    return plan
