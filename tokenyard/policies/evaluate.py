"""decide(): one request's route under a policy, as a pure function.

    decide(policy, request, spend, engines, router_score, router_threshold=None,
           router_scores=None, router_pick=None) -> Decision

Order, each step explained in Decision.explanation:
  1. rules: the first matching rule (document order) applies; it may deny (stop), pin an
     engine, force the router, set the priority class and cap max_tokens;
  2. route: a rule's pin or router wins; else an engine the client named is honoured
     ("pinned"); else "auto" goes through the router: small when score >= threshold
     (score = P(small is enough)); no score -> router.without_score ("router_fallback").
     An N-engine router passes router_scores (P(good) per engine, cheapest first) and its own
     pick (under router.cost_cap, or its default): a quality target (the rule's action, else
     router.quality_target) picks the cheapest engine whose P(good) reaches it (none does: the
     highest P(good)); without a target the router's pick stands;
  3. budget: the spend so far (today, this month; UTC) of the tenant, the request's key and its
     tag values against their budgets (tokenyard/policies/budgets.py); any at or over a limit: deny
     ("insufficient_quota") if one of those says deny, else downgrade to engines.small ("budget_downgrade");
  4. overflow: the chosen engine is unhealthy or its predicted TTFT exceeds the deadline ->
     move to the other engine if allowed and it can make it ("overflow_degrade"), else shed.
Budget is checked before overflow so an overloaded small engine is never escaped by moving a
tenant that is over budget up to the large one. With engines.tiers (N engines) overflow moves one
tier: down from any engine but the cheapest, up from the cheapest (which needs overflow.upgrade).

The threshold used: policy.router.threshold if set, else router_threshold (the router's own,
from its artifact or resolved from router.target_large_share by the router), else 0.5.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .budgets import Scope, over_limit, scopes
from .cost import estimate_cost
from .matching import RequestFeatures, first_match
from .schema import AUTO, Action, Policy

__all__ = ["Decision", "Denial", "EngineState", "RequestFeatures", "TenantSpend", "decide", "estimate_cost",
           "DEFAULT_THRESHOLD"]

DEFAULT_THRESHOLD = 0.5


@dataclass(slots=True, frozen=True)
class TenantSpend:
    """Spend so far in micro-units: this UTC day and this UTC calendar month (from the spend ledger's
    rollups), of the tenant (today, month) and of the request's key and tag values that have budgets
    (scoped: (dim, value, today, month) with dim "key" or "tag:NAME", as tokenyard.policies.budgets.Scope)."""

    today: int = 0
    month: int = 0
    scoped: tuple[tuple[str, str, int, int], ...] = ()

    def of(self, dim: str, value: str) -> tuple[int, int]:
        """(today, month) of one scope; "" is the tenant; a scope not given has spent nothing."""
        if not dim:
            return self.today, self.month
        for d, v, today, month in self.scoped:
            if d == dim and v == value:
                return today, month
        return 0, 0


@dataclass(slots=True, frozen=True)
class EngineState:
    """What the gateway knows of an engine now: the admission queue's predicted time to first
    token for a request arriving now, and whether it is serving at all."""

    predicted_ttft_ms: float = 0.0
    healthy: bool = True


@dataclass(slots=True, frozen=True)
class Denial:
    """An OpenAI-style error the HTTP edge turns into its JSON body and status."""

    status: int            # 403 policy, 429 budget, 503 shed
    type: str              # OpenAI error type
    code: str              # policy_denied | insufficient_quota | deadline_exceeded | engine_unavailable
    message: str


@dataclass(slots=True)
class Decision:
    """Where a request goes and why. engine is None exactly when denied or shed.

    action: how the route was chosen before budget/overflow: "pin" (a rule pinned it),
    "router", "requested" (the client named the engine), "deny" (a rule), or after them
    "downgrade", "degrade", "budget_deny", "shed".
    reason: the route reason for metrics, headers and the spend record: "rule:<name>",
    "router", "router_fallback", "pinned", "budget_downgrade", "overflow_degrade",
    "budget_exceeded", "overflow_shed".
    """

    engine: str | None
    action: str
    reason: str
    priority: str
    max_tokens: int | None
    denied: bool = False
    shed: bool = False
    error: Denial | None = None
    rule_index: int | None = None
    rule_name: str | None = None
    router_score: float | None = None
    threshold: float | None = None
    downgraded: bool = False          # by the budget
    degraded: bool = False            # by overflow
    rate_class: str | None = None
    explanation: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON shape for the admin API and the simulation's drill-down."""
        out = {k: getattr(self, k) for k in self.__slots__ if k != "error"}
        out["error"] = None if self.error is None else {"status": self.error.status, "type": self.error.type,
                                                        "code": self.error.code, "message": self.error.message}
        return out


def effective_threshold(policy: Policy, router_threshold: float | None) -> float:
    if policy.router.threshold is not None:
        return policy.router.threshold
    return router_threshold if router_threshold is not None else DEFAULT_THRESHOLD


def small_is_enough(score: float, threshold: float) -> bool:
    """The one small/large rule: the router's score is P(small is enough); at or above the threshold
    the small engine serves. The policy path here and the gateway's router hook both use it."""
    return score >= threshold


def cheapest_good_enough(router_scores: Mapping[str, float], target: float) -> str:
    """The first engine (cheapest first) whose P(good) >= target; none: the highest P(good),
    the cheaper one on a tie (tokenyard.router_models.runtime.selection's rule, here over names)."""
    for name, p in router_scores.items():
        if p >= target:
            return name
    best = max(router_scores.values())
    return next(name for name, p in router_scores.items() if p == best)


def decide(policy: Policy, request: RequestFeatures, spend: TenantSpend, engines: dict[str, EngineState],
           router_score: float | None, router_threshold: float | None = None,
           router_scores: Mapping[str, float] | None = None, router_pick: str | None = None) -> Decision:
    why: list[str] = []
    tenant = policy.tenant(request.tenant)
    hit = first_match(policy, request)
    action: Action | None = None
    d = Decision(engine=None, action="", reason="", priority=policy.default_priority,
                 max_tokens=request.max_tokens, rate_class=tenant.rate_class, explanation=why)
    if hit is None:
        why.append(f"no rule matched ({len(policy.rules)} checked)")
    else:
        d.rule_index, rule = hit
        d.rule_name, action = rule.name, rule.action
        why.append(f"rule {d.rule_index} '{rule.name}' matched (first match wins)")
        if action.priority is not None:
            d.priority = action.priority
            why.append(f"rule sets priority {action.priority}")
        if action.max_tokens is not None:
            asked = request.max_tokens
            d.max_tokens = action.max_tokens if asked is None else min(asked, action.max_tokens)
            why.append(f"rule caps max_tokens at {action.max_tokens} (asked {asked}, now {d.max_tokens})")
        if action.deny is not None:
            d.action, d.reason, d.denied = "deny", f"rule:{rule.name}", True
            d.error = Denial(403, "permission_error", "policy_denied", action.deny)
            why.append("rule denies the request")
            return d

    # 2. route
    if action is not None and action.pin is not None:
        d.engine, d.action, d.reason = action.pin, "pin", f"rule:{d.rule_name}"
        why.append(f"rule pins {action.pin}")
    elif request.requested_model != AUTO and not (action is not None and action.router):
        d.engine, d.action, d.reason = request.requested_model, "requested", "pinned"
        why.append(f"client named {request.requested_model}; honoured")
    else:
        d.action = "router"
        if action is not None and action.router and request.requested_model != AUTO:
            why.append(f"rule sends the request to the router instead of {request.requested_model}")
        d.router_score = router_score
        if router_scores:
            _n_engine_route(policy, action, router_scores, router_pick, d)
        elif router_score is None:
            d.engine = getattr(policy.engines, policy.router.without_score)
            d.reason = "router_fallback"
            why.append(f"no router score; router.without_score sends it to {d.engine}")
        else:
            d.threshold = effective_threshold(policy, router_threshold)
            small = small_is_enough(router_score, d.threshold)
            d.engine = policy.engines.small if small else policy.engines.large
            d.reason = "router"
            why.append(f"router score {router_score:.4f} {'>=' if small else '<'} threshold "
                       f"{d.threshold:.4f}: {d.engine}")

    # 3. budget
    if _budget(policy, request, spend, d):
        return d

    # 4. overflow
    _overflow(policy, request, engines, d, action.degrade if action is not None else None)
    return d


def _n_engine_route(policy: Policy, action: Action | None, scores: Mapping[str, float], pick: str | None, d: Decision) -> None:
    shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items())
    target = action.quality_target if action is not None and action.quality_target is not None \
        else policy.router.quality_target
    d.reason = "router"
    if target is not None:
        d.engine = cheapest_good_enough(scores, target)
        whose = "the rule's" if action is not None and action.quality_target is not None else "router.quality_target"
        d.explanation.append(f"router P(good): {shown}; cheapest reaching {whose} {target:g}: {d.engine}")
    else:
        d.engine = pick if pick is not None else cheapest_good_enough(scores, 1.0)
        d.explanation.append(f"router P(good): {shown}; the router's selection: {d.engine}")


def _budget(policy: Policy, request: RequestFeatures, spend: TenantSpend, d: Decision) -> bool:
    """Step 3: every budget of the request (tenant, key, tag values); True when denied. Any reached
    budget with at_limit deny denies; else any reached one downgrades."""
    why = d.explanation
    found = scopes(policy, request.tenant, request.key_id, request.key_name, request.tags)
    if not found:
        return False
    reached: list[tuple[Scope, list[str]]] = []
    for scope in found:
        over = over_limit(scope.budget, *spend.of(scope.dim, scope.value))
        if over:
            reached.append((scope, over))
    if not reached:
        why.append("within budget" if len(found) == 1 else f"within budget ({len(found)} budgets checked)")
        return False
    for scope, over in reached:
        head = "budget reached: " if not scope.dim else f"budget reached ({scope.label()}): "
        why.append(head + "; ".join(over))
    denying = [(s, o) for s, o in reached if s.budget.at_limit == "deny"]
    if denying:
        scope, over = denying[0]
        who = f"Tenant {request.tenant}" if not scope.dim else \
            f"The {scope.label()} of tenant {request.tenant}"
        d.engine, d.action, d.reason, d.denied = None, "budget_deny", "budget_exceeded", True
        d.error = Denial(429, "insufficient_quota", "insufficient_quota",
                         f"{who} has reached its spend budget ({over[0]}).")
        why.append("budget at_limit is deny")
        return True
    if d.engine != policy.engines.small:
        why.append(f"budget at_limit is downgrade: {d.engine} -> {policy.engines.small}")
        d.engine, d.action, d.reason, d.downgraded = policy.engines.small, "downgrade", "budget_downgrade", True
    else:
        why.append("budget at_limit is downgrade; already on the small engine")
    return False


def _cannot_meet(engines: dict[str, EngineState], engine: str, deadline_ms: float | None) -> str | None:
    """Why `engine` cannot serve this request in time, or None. No state known: assume it can
    (overflow acts on evidence, not on missing data)."""
    state = engines.get(engine)
    if state is None:
        return None
    if not state.healthy:
        return f"{engine} is unhealthy"
    if deadline_ms is not None and state.predicted_ttft_ms > deadline_ms:
        return f"{engine} predicted TTFT {state.predicted_ttft_ms:g} ms > deadline {deadline_ms:g} ms"
    return None


def _pricier(policy: Policy, target: str, engine: str) -> bool:
    order = policy.engines.ordered
    return order.index(target) > order.index(engine)


def _overflow(policy: Policy, request: RequestFeatures, engines: dict[str, EngineState], d: Decision,
              rule_degrade: bool | None) -> None:
    ov, why = policy.overflow, d.explanation
    if not ov.enabled or d.engine is None:
        return
    problem = _cannot_meet(engines, d.engine, request.deadline_ms)
    if problem is None:
        return
    why.append(f"overflow: {problem}")
    target = policy.engines.other(d.engine)
    allowed = rule_degrade if rule_degrade is not None else ov.degrade
    blocked = None
    if not allowed:
        blocked = "degrade is off for this request" if rule_degrade is False else "overflow.degrade is off"
    elif target is None:
        blocked = f"{d.engine} has no other engine (not in engines)"
    elif engines and target not in engines:
        # engines.tiers may price an engine this deployment does not run; never route to it
        blocked = f"{target} is not an engine of this deployment"
    elif d.action == "requested" and not ov.degrade_pinned:
        blocked = "the client named the engine and overflow.degrade_pinned is off"
    elif _pricier(policy, target, d.engine) and d.downgraded:
        blocked = "the request was downgraded by its budget"
    elif _pricier(policy, target, d.engine) and not ov.upgrade:
        blocked = ("moving small -> large needs overflow.upgrade" if target == policy.engines.large
                   else f"moving {d.engine} -> {target} (pricier) needs overflow.upgrade")
    else:
        other_problem = _cannot_meet(engines, target, request.deadline_ms)
        if other_problem is None:
            why.append(f"overflow degrade: {d.engine} -> {target}")
            d.engine, d.action, d.reason, d.degraded = target, "degrade", "overflow_degrade", True
            return
        blocked = other_problem
    why.append(f"cannot degrade: {blocked}")
    if not ov.shed:
        why.append(f"overflow.shed is off: stays on {d.engine}; admission decides")
        return
    unhealthy = not engines[d.engine].healthy
    d.error = Denial(503, "service_unavailable", "engine_unavailable" if unhealthy else "deadline_exceeded",
                     f"Engine {d.engine} is unavailable" if unhealthy else
                     f"No engine can start this request within its deadline of {request.deadline_ms:g} ms")
    why.append("shed")
    d.engine, d.action, d.reason, d.shed = None, "shed", "overflow_shed", True
