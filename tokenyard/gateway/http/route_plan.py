"""Policy and route for one chat or text completion request: the step between authentication and
the limits.

    plan = await plan_route(gw, req, key, deadline)     # raises the policy's 403 / 429 / 503

1. The requested model: "auto", an engine name, or ENGINE:ADAPTER, one of an engine's LoRA adapters (anything
   else is 404 model_not_found). The adapter goes with the plan only while the plan's engine is that engine
   (Plan.adapter): a policy or the context fit that moves the request to another engine serves it there without.
2. The prompt's token ids come from the rendering step before this one (tokenyard/gateway/prompt/rendering.py:
   template, tools and encoding, once per tokenizer; on the prompt threads when the prompt is long,
   tokenyard/gateway/prompt/prompt_guard.py): the pinned engine's tokenizer, else the counting engine's;
   again only if the engine finally chosen has another tokenizer.
3. The learned router (deployment `router:`) scores every prompt: P(small is enough),
   to metrics, the response headers and the usage record (the replay of a policy needs it).
4. Without a policy (the built-in default, version 0) the deployment's routing decides: a named
   engine is served ("pinned"); "auto" goes through the learned router ("router": small when the
   score >= its threshold) or, without one, the interim rule of routing.py.
5. With a policy: tokenyard.policies.decide(policy, features, tenant spend, engine states, score,
   threshold). Features: tenant, key name and id, requested model, prompt tokens, max_tokens,
   metadata tags, arrival time (UTC) and the time left before the request's start deadline.
   Spend (today, this month) of the tenant and of the request's key and tag values that have a
   budget comes from the spend rollups (tokenyard/gateway/spend/budget.py), read only when a budget applies.
   Engine states: admission's predicted queue wait of each engine
   for this tenant and class (its predicted TTFT) and whether the engine is alive. The decision
   gives the engine, the priority class, a max_tokens cap, the route reason, or a refusal:
   policy deny 403 policy_denied, budget 429 insufficient_quota, overflow with nowhere to go 503
   deadline_exceeded / engine_unavailable (with retry-after) — all before any limit is reserved.
Prices: the policy's prices for the chosen engine (and the baseline engine) price the usage
record; engines the policy does not price keep the deployment's prices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.auth.api_keys import PRIORITIES, KeyRecord
from tokenyard.gateway.edge.chat_request import ChatRequest
from tokenyard.gateway.edge.completion_request import CompletionRequest
from tokenyard.gateway.edge.errors import APIError, BadRequest, Forbidden, RateLimited, Unavailable, retry_headers
from tokenyard.gateway.prompt.context_trim import ContextTooLong, trim_to_fit
from tokenyard.gateway.prompt.prompt_guard import prompt_work
from tokenyard.gateway.prompt.rendering import RenderedPrompt, tokenize
from tokenyard.gateway.routing.context_route import move_to_fit
from tokenyard.gateway.routing.engine_set_router import EngineSetRouter
from tokenyard.gateway.routing.learned_router import LearnedRouter
from tokenyard.gateway.routing.traffic_learning import Observation
from tokenyard.gateway.spend.budget_hold import BudgetCharge, meters_for
from tokenyard.policies import EngineState, RequestFeatures, TenantSpend, decide
from tokenyard.policies.adapter_access import allows
from tokenyard.policies.budgets import over_limit
from tokenyard.policies.budgets import scopes as budget_scopes
from tokenyard.policies.evaluate import effective_threshold, small_is_enough
from tokenyard.policies.schema import ContextLimit
from tokenyard.router_models.runtime.features import prompt_text

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

MAX_PREDICTED_MS = 3_600_000.0


@dataclass(slots=True)
class Plan:
    engine: str
    reason: str
    prompt_ids: list[int]
    score: float | None = None
    priority: int | None = None                 # admission class index; None: the key's
    max_tokens: int | None = None               # after a rule's cap; None: the deployment default applies
    rate: tuple[int, int, int] | None = None    # the policy's rate class for the tenant
    prices: Any = None                          # deployment.Prices from the policy (None: the engine's)
    baseline_prices: Any = None
    policy_version: int = 0
    engine_state: dict[str, dict[str, Any]] | None = None
    explanation: list[str] = field(default_factory=list)
    context_dropped_tokens: int = 0             # prompt tokens the policy's context limit trimmed away
    budget: BudgetCharge | None = None          # the budgets to hold the worst-case cost against (admission)
    routed_prompt_tokens: int = 0               # the count routing and the policy decided with (the usage record)
    prompt: RenderedPrompt | None = None        # the request's prompt, encoded per tokenizer (rendering.py)
    fallback: Any = None                        # policies.Fallback: where a failed upstream call may go next
    tried: tuple[str, ...] = ()                 # engines a fallback already left
    router_text: str | None = None              # what the two-engine router scored (traffic learning)
    router_view: tuple[Any, ...] = ()           # (router, policy, router threshold, shadow) it was scored under
    lora: tuple[str, str] | None = None         # (engine, adapter) the request named as ENGINE:ADAPTER

    @property
    def adapter(self) -> str | None:
        """The LoRA adapter to run with: the one named, if the plan still goes to its engine."""
        return self.lora[1] if self.lora is not None and self.lora[0] == self.engine else None


def observe_route(gw: "Gateway", request_id: str, key: KeyRecord, req: Any, plan: Plan) -> None:
    """Hand a request the two-engine router scored to traffic learning (a feedback sample, the
    shadow candidate's counts; tokenyard/gateway/routing/traffic_learning.py). Never changes the route."""
    if plan.router_text is None or plan.score is None or not plan.router_view:
        return
    # The version the request was routed under, even if another was installed since.
    router, policy, router_threshold, shadow = plan.router_view
    if not isinstance(router, LearnedRouter):
        return
    threshold = router.threshold if policy is None else effective_threshold(policy, router_threshold)
    gw.learning.observe(Observation(
        request_id=request_id, tenant=key.tenant, metadata=req.metadata, text=plan.router_text,
        prompt_tokens=plan.routed_prompt_tokens or len(plan.prompt_ids), engine=plan.engine, score=plan.score,
        current_large=not small_is_enough(plan.score, threshold), router=router,
        current_ref=(policy.router.artifact if policy is not None else None) or "deployment",
        shadow=shadow, shadow_ref=policy.router.shadow if policy is not None else None,
        shadow_threshold=(policy.router.threshold if policy is not None and policy.router.threshold is not None
                          else None)))


def _ids(gw: "Gateway", engine: str, prompt: RenderedPrompt) -> tuple[Any, list[int]]:
    tok = gw.handles[engine].tokenizer
    return tok, prompt.ids(tok)


def _router_text(req: ChatRequest | CompletionRequest, tok: Tokenizer, ids: list[int]) -> str:
    """The text the learned router scores: the messages' contents, or the completion prompt."""
    if isinstance(req, ChatRequest):
        return prompt_text(req.messages)
    return req.prompt if isinstance(req.prompt, str) else tok.decode(ids)


def engine_states(gw: "Gateway", tenant: str, priority: int) -> dict[str, EngineState]:
    out = {}
    for name, h in gw.handles.items():
        q = gw.admission.queues.get(name)
        wait_s = q.predicted_wait(tenant, priority) if q is not None else 0.0
        ms = MAX_PREDICTED_MS if not math.isfinite(wait_s) else min(wait_s * 1000, MAX_PREDICTED_MS)
        out[name] = EngineState(predicted_ttft_ms=ms, healthy=not h.engine.dead)
    return out


async def plan_route(gw: "Gateway", req: ChatRequest | CompletionRequest, key: KeyRecord, deadline: float,
                     prompt: RenderedPrompt | None = None) -> Plan:
    """prompt: the request's rendered prompt (made here when not given); the plan keeps it."""
    prompt = prompt or RenderedPrompt(req)
    plan = await _route(gw, req, key, deadline, prompt)
    plan.prompt = prompt
    pinned = gw.router.pinned(req.model)
    if plan.lora is None and pinned is not None and pinned.lora is not None:
        plan.lora = (pinned.engine, pinned.lora)
    if plan.adapter is not None:
        check_adapter_access(gw, key, f"{plan.engine}:{plan.adapter}")
    if plan.budget is not None:     # the worst case is reckoned at the prices the request is billed at
        plan.budget.prices = plan.prices or gw.handles[plan.engine].prices
    if req.priority is not None:
        # The request's service_tier / priority may lower its class, never raise it above its
        # key's or a policy rule's.
        base = key.priority_class if plan.priority is None else plan.priority
        plan.priority = max(base, req.priority)
    return plan


async def _route(gw: "Gateway", req: ChatRequest | CompletionRequest, key: KeyRecord, deadline: float,
                 prompt: RenderedPrompt) -> Plan:
    pinned = gw.router.pinned(req.model)          # NotFound for unknown names
    state = gw.policy
    policy = state.policy
    counting = pinned.engine if pinned is not None else gw.router.counting_engine
    tok, ids = await prompt_work(req, _ids, gw, counting, prompt)   # template + encode (threads if long)
    score = None
    chosen = None                   # an N-engine router's pick (EngineSetRouter)
    # Every request is scored when the router is configured, not only "auto" ones: a rule may send a
    # named-engine request to the router, and the what-if replay of a future policy needs the score
    # in every usage record. Scoring is a hashed dot product (tens of microseconds).
    learned = state.router          # the deployment's router, or the one the policy promoted
    text = None
    if isinstance(learned, EngineSetRouter):
        # a policy's cost cap is resolved by the router (its calibration table); its quality target
        # (or a rule's) by tokenyard.policies.decide from the scores
        cap = policy.router.cost_cap if policy is not None else None
        chosen = learned.decide(_router_text(req, tok, ids), len(ids), cost_cap=cap)
        score = chosen.score
        gw.metrics.router_score.observe(score)
    elif learned is not None:
        text = _router_text(req, tok, ids)
        score = learned.scorer.score(text, len(ids))
        gw.metrics.router_score.observe(score)
    view = (learned, state.policy, state.router_threshold, state.shadow)   # what _decide reads, before any await
    plan = await _decide(gw, req, key, deadline, prompt, pinned, tok, ids, score, chosen)
    if text is not None:
        plan.router_text, plan.router_view = text, view
    return plan


async def _decide(gw: "Gateway", req: ChatRequest | CompletionRequest, key: KeyRecord, deadline: float,
                  prompt: RenderedPrompt, pinned: Any, tok: Any, ids: list[int], score: float | None,
                  chosen: Any) -> Plan:
    state = gw.policy
    policy = state.policy
    learned = state.router
    if policy is None:
        if pinned is not None:
            return Plan(pinned.engine, pinned.reason, ids, score, max_tokens=req.max_tokens,
                        routed_prompt_tokens=len(ids))
        if chosen is not None:
            engine, reason = chosen.engine, chosen.reason
        elif learned is not None:
            engine = learned.engine_for(score)
            reason = "router"
        else:
            route = gw.router.auto(len(ids))
            engine, reason = route.engine, route.reason
        plan = _split_adapter(Plan(engine, reason, ids, score, max_tokens=req.max_tokens,
                                   routed_prompt_tokens=len(ids)))
        if chosen is not None:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in (chosen.scores or {}).items())
            plan.explanation.append(f"router P(good): {shown}; chose {engine}")
        return await prompt_work(req, lambda: _finish(gw, prompt, tok, _fit(gw, prompt, tok, plan)))

    import asyncio
    loop = asyncio.get_running_loop()
    left_ms = max(0.0, (deadline - loop.time()) * 1000)
    features = RequestFeatures(tenant=key.tenant, time=datetime.now(timezone.utc), requested_model=req.model,
                               prompt_tokens=len(ids), max_tokens=req.max_tokens, key_name=key.name or None,
                               key_id=key.key_id, tags=dict(req.metadata or {}), deadline_ms=left_ms)
    spend = TenantSpend()
    found = budget_scopes(policy, key.tenant, key.key_id, key.name or None, features.tags)
    if found:
        spend, known = await gw.budgets.spend(key.tenant, [(s.dim, s.value) for s in found if s.dim])
        reached = any(over_limit(s.budget, *spend.of(s.dim, s.value)) for s in found)
        gw.metrics.budget_checks.labels("unavailable" if not known else "reached" if reached else "within").inc()
    states = engine_states(gw, key.tenant, key.priority_class)
    if pinned is not None and pinned.lora is not None:    # an adapter's state is its engine's (overflow reads it)
        states[f"{pinned.engine}:{pinned.lora}"] = states[pinned.engine]
    d = decide(policy, features, spend, states, score, state.router_threshold,
               router_scores=chosen.scores if chosen is not None else None,
               router_pick=chosen.engine if chosen is not None else None)
    gw.metrics.policy_decisions.labels(d.action).inc()
    if d.error is not None and d.error.code == "engine_unavailable":
        # The engine is down (an upstream whose deployments all rest): the policy's fallback chain
        # for errors, when it has a live engine, takes the request instead of the 503.
        chain = policy.fallback_for(key.tenant, d.rule_index)
        nxt = chain.next_engine("error", lambda n: n in states and states[n].healthy) if chain else None
        if nxt is not None:
            gw.metrics.upstream_fallbacks.labels(pinned.engine if pinned is not None else "auto", "error").inc()
            d.error, d.engine, d.reason, d.action = None, nxt, "fallback_error", "fallback"
    if d.error is not None:
        raise _refusal(d.error, states)
    dropped = 0
    limit = policy.context_for(key.tenant, d.rule_index)
    if limit is not None and len(ids) > limit.max_prompt_tokens:
        ids, dropped = await prompt_work(req, _fit_context, prompt, tok, ids, limit)
    rule_priority = d.rule_index is not None and policy.rules[d.rule_index].action.priority is not None
    priority = PRIORITIES.index(d.priority) if rule_priority else max(key.priority_class,
                                                                        PRIORITIES.index(d.priority))
    plan = Plan(d.engine, d.reason, ids, score, priority=priority, max_tokens=d.max_tokens,
                rate=state.rate_for(key.tenant), prices=state.prices.get(d.engine.partition(":")[0]),
                baseline_prices=state.prices.get(gw.baseline_engine), policy_version=state.number,
                engine_state={n: {"predicted_ttft_ms": round(s.predicted_ttft_ms, 3), "healthy": s.healthy}
                              for n, s in states.items()},
                explanation=d.explanation, context_dropped_tokens=dropped,
                routed_prompt_tokens=features.prompt_tokens, fallback=policy.fallback_for(key.tenant, d.rule_index))
    _split_adapter(plan)
    if found:       # held at admission, settled with the usage record (tokenyard/gateway/spend/budget_hold.py)
        plan.budget = BudgetCharge(gw.budgets.holds, key.tenant, meters_for(found, spend.of), None)
    return await prompt_work(req, lambda: _finish(gw, prompt, tok, _fit(gw, prompt, tok, plan,
                                                                          lambda e: state.prices.get(e))))


def check_adapter_access(gw: "Gateway", key: KeyRecord, model: str) -> None:
    """403 adapter_not_allowed unless the key's allow list and its tenant's (the policy's) both allow the
    LoRA adapter `model` (ENGINE:ADAPTER; tokenyard/policies/adapter_access.py)."""
    policy = gw.policy.policy
    tenant = policy.tenant(key.tenant).adapters if policy is not None else None
    for patterns, whose in ((key.adapters, f"API key {key.name or key.key_id}"), (tenant, f"tenant {key.tenant}")):
        if not allows(patterns, model):
            raise Forbidden(f"The {whose} may not use the LoRA adapter '{model}' (allowed: "
                            f"{', '.join(patterns) or 'none'})", param="model", code="adapter_not_allowed")


def _split_adapter(plan: Plan) -> Plan:
    """A route to ENGINE:ADAPTER (a policy's pin, the router's engine set, a requested adapter the policy
    honoured) runs on ENGINE with ADAPTER."""
    engine, sep, adapter = plan.engine.partition(":")
    if sep:
        plan.engine, plan.lora = engine, (engine, adapter)
    return plan


def _fit(gw: "Gateway", prompt: RenderedPrompt, tok: Any, plan: Plan, prices_for=None) -> Plan:
    """A routed prompt too long for its engine's context moves to one whose context holds it."""
    return move_to_fit(gw, plan, tok, lambda engine: _ids(gw, engine, prompt)[1], prices_for)


def _fit_context(prompt: RenderedPrompt, tok: Tokenizer, ids: list[int],
                 limit: ContextLimit) -> tuple[list[int], int]:
    """The policy's context limit: a chat's oldest turns dropped to fit (the messages replaced), or
    400 context_length_exceeded. Returns the new prompt ids and the tokens dropped."""
    req = prompt.req
    if not isinstance(req, ChatRequest):
        raise BadRequest(f"The prompt has {len(ids)} tokens; the policy allows at most {limit.max_prompt_tokens} "
                         "prompt tokens for this request (a text prompt is never trimmed)", param="prompt",
                         code="context_length_exceeded")
    try:
        kept, dropped = trim_to_fit(req.messages, lambda m: len(tokenize(tok, m, req.tools)),
                                    limit.max_prompt_tokens, trim=limit.trim != "none", tokens=len(ids))
    except ContextTooLong as e:
        raise BadRequest(str(e), param="messages", code="context_length_exceeded") from e
    kept_ids = tokenize(tok, kept, req.tools)
    prompt.replace_messages(kept, tok, kept_ids)
    return kept_ids, dropped


def _finish(gw: "Gateway", prompt: RenderedPrompt, counted_with: Any, plan: Plan) -> Plan:
    if gw.handles[plan.engine].tokenizer is not counted_with:
        plan.prompt_ids = _ids(gw, plan.engine, prompt)[1]
    return plan


def _refusal(denial: Any, states: dict[str, EngineState]) -> APIError:
    if denial.status == 503:
        waits = [s.predicted_ttft_ms for s in states.values() if s.healthy]
        return Unavailable(denial.message, code=denial.code,
                           headers=retry_headers(min(waits) / 1000 if waits else 1.0))
    cls = {403: Forbidden, 429: RateLimited}.get(denial.status, Forbidden)
    err = cls(denial.message, code=denial.code)
    err.type = denial.type
    return err
