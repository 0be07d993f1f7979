"""The policy model: what a validated policy document holds, as immutable records.

A Policy is only ever built by validation.load_policy (from YAML) or validation.build_policy
(from a plain mapping), so every instance is valid: engine names in rules resolve, ranges are
ordered, money is integer micro-units. Instances are frozen because the gateway swaps the whole
policy atomically on a new version and many requests read it at once.

Every key, its allowed values and its default are documented in policies/README.md.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from .cost import request_cost

SCHEMA_VERSION = 1
PRIORITIES = ("interactive", "batch")
AT_LIMIT = ("deny", "downgrade")
ROLES = ("small", "large")
TRIM_MODES = ("none", "keep_system_and_latest")
DEFAULT_BATCH_PRICE_PERCENT = 50   # Batch API work is charged this percent of the engine's prices
DEFAULT_TENANT = "*"             # the tenants entry used for tenants not listed by name
AUTO = "auto"                    # the requested model that asks for the router


@dataclass(slots=True, frozen=True)
class Prices:
    """Integer micro-units of currency per million tokens, per kind of token. The one price table of
    the project: the deployment's engine prices and a policy's prices are both this type."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int, percent: int = 100) -> int:
        """Cost of one request in integer micro-units, by the one rule in tokenyard/policies/cost.py;
        percent: share of these prices charged (the batch price), applied inside its rounding."""
        return request_cost(self, prompt_tokens, cached_tokens, completion_tokens, percent)


@dataclass(slots=True, frozen=True)
class EngineRoles:
    """Which engine is the cheap one and which the strong one: the router, budget downgrade and
    overflow degrade move requests between these two."""

    small: str
    large: str
    tiers: tuple[str, ...] = ()      # optional: every engine in cost order, small first, large last

    @property
    def ordered(self) -> tuple[str, ...]:
        """The engines cheapest first: tiers, else (small, large)."""
        return self.tiers or (self.small, self.large)

    def other(self, engine: str) -> str | None:
        """Where overflow moves a request: from the cheapest engine up one tier, from any other
        engine down one tier (with two engines: small <-> large); None for engines not listed."""
        order = self.ordered
        if engine not in order:
            return None
        i = order.index(engine)
        return order[1] if i == 0 else order[i - 1]


@dataclass(slots=True, frozen=True)
class RouterSettings:
    """The router's score is P(small is enough); a request goes small when score >= threshold.

    threshold overrides the router artifact's calibrated one; target_large_share asks the router
    to pick the threshold giving that share of large calls (resolved by the router, outside this
    package). At most one is set; neither keeps the artifact's threshold.
    """

    threshold: float | None = None
    target_large_share: float | None = None
    without_score: str = "large"     # where "auto" goes when there is no score (router missing)
    # An N-engine router (P(good) per engine) instead: the cheapest engine whose P(good) reaches
    # quality_target, or the best engines for a mean relative cost cost_cap (resolved by the router).
    # At most one of the two; the threshold settings above apply to two-engine routers only.
    quality_target: float | None = None
    cost_cap: float | None = None
    # A two-engine router artifact published to the deployment's Redis, named by its checksum
    # ("sha256:<64 hex>"; `tokenyard router publish`): `artifact` replaces the deployment's router
    # (promotion), `shadow` is scored beside the router in force and only counted (shadow mode,
    # docs/router.md). Both resolved and verified by the gateway, outside this package.
    artifact: str | None = None
    shadow: str | None = None


@dataclass(slots=True, frozen=True)
class TokenRange:
    """Inclusive bounds on prompt tokens; None is unbounded on that side."""

    min: int | None = None
    max: int | None = None

    def contains(self, n: int) -> bool:
        return (self.min is None or n >= self.min) and (self.max is None or n <= self.max)


@dataclass(slots=True, frozen=True)
class TimeRange:
    """Minutes after midnight UTC: start inclusive, end exclusive; end <= start wraps midnight
    (22:00-06:00 covers the night). end == start is refused by validation (ambiguous)."""

    start: int
    end: int

    def contains(self, minute: int) -> bool:
        if self.start < self.end:
            return self.start <= minute < self.end
        return minute >= self.start or minute < self.end


@dataclass(slots=True, frozen=True)
class Match:
    """Conditions of a rule. Every condition given must hold (AND); a list matches when any of
    its values does (OR); an empty Match matches every request."""

    tenants: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()                 # key names or key ids
    models: tuple[str, ...] = ()               # requested model: "auto", an engine name or ENGINE:ADAPTER
    prompt_tokens: TokenRange | None = None
    tags: tuple[tuple[str, tuple[str, ...]], ...] = ()   # (tag, allowed values), sorted by tag
    time_utc: tuple[TimeRange, ...] = ()


@dataclass(slots=True, frozen=True)
class ContextLimit:
    """How long a prompt may be. A chat prompt over max_prompt_tokens is trimmed when trim is
    "keep_system_and_latest" (the oldest turns go first; system messages and the last user turn
    always stay) and refused with a 400 when trim is "none" or trimming cannot fit it."""

    max_prompt_tokens: int
    trim: str = "keep_system_and_latest"


FALLBACK_ON = ("error", "rate_limit", "context_length")


@dataclass(slots=True, frozen=True)
class Fallback:
    """Where a request goes when its engine fails before the first token reaches the client: the
    engines in order, on which failures (an upstream's error or timeout after its retries, its 429,
    or a prompt too long for its context)."""

    engines: tuple[str, ...]
    on: tuple[str, ...] = FALLBACK_ON

    def next_engine(self, reason: str, live: Callable[[str], bool], tried: Iterable[str] = ()) -> str | None:
        """The first engine of the chain that is live and not tried yet, when the chain covers `reason`."""
        if reason not in self.on:
            return None
        skip = set(tried)
        return next((e for e in self.engines if e not in skip and live(e)), None)


@dataclass(slots=True, frozen=True)
class Action:
    """What a matching rule does. At most one of pin / router / deny (the route); priority,
    max_tokens and degrade combine with any route. No route keeps the default routing (the
    requested engine, or the router for "auto")."""

    pin: str | None = None           # serve on this engine, whatever was requested
    router: bool = False             # use the router even when an engine was requested
    deny: str | None = None          # refuse with this message (code "policy_denied")
    priority: str | None = None      # "interactive" | "batch"
    max_tokens: int | None = None    # cap on the request's max_tokens
    degrade: bool | None = None      # overflow may move this request to the other engine; None: overflow's default
    context: ContextLimit | None = None  # replaces the tenant's context limit for matching requests
    quality_target: float | None = None  # N-engine router: this target for matching requests
    fallback: Fallback | None = None     # replaces the tenant's fallback chain for matching requests


@dataclass(slots=True, frozen=True)
class Rule:
    name: str
    match: Match = field(default_factory=Match)
    action: Action = field(default_factory=Action)


@dataclass(slots=True, frozen=True)
class Budget:
    """Spend limits in micro-units; None is no limit. At the limit (spent >= limit) the request
    is denied or downgraded to the small engine."""

    per_day: int | None = None
    per_month: int | None = None
    at_limit: str = "deny"


@dataclass(slots=True, frozen=True)
class RateClass:
    """Per-tenant request and token rates the gateway's limiter enforces. burst is the bucket
    size in requests (default: one minute's worth)."""

    requests_per_min: int
    tokens_per_min: int
    burst: int


@dataclass(slots=True, frozen=True)
class TenantPolicy:
    """A tenant's rate class, fair-share weight, context limit and budgets.

    weight: under saturation the admission queues give each waiting tenant tokens in proportion
    to it. context: the longest prompt (trimmed or refused past it). budget limits the tenant as
    a whole; key_budgets limit each matching API key of the tenant on its own (by key id, else key name, else "*": every
    key); tag_budgets limit, per metadata tag NAME, each matching value (the value, else "*":
    every value of that tag) on its own. All count UTC days and calendar months (tokenyard/policies/budgets.py)."""

    rate_class: str | None = None
    budget: Budget | None = None
    key_budgets: dict[str, Budget] = field(default_factory=dict)
    tag_budgets: dict[str, dict[str, Budget]] = field(default_factory=dict)
    weight: int = 1
    context: ContextLimit | None = None
    fallback: Fallback | None = None
    # LoRA adapters the tenant's keys may use (ENGINE:ADAPTER, ENGINE:*, *: tokenyard/policies/adapter_access.py);
    # None: every adapter.
    adapters: tuple[str, ...] | None = None


@dataclass(slots=True, frozen=True)
class Overflow:
    """When the chosen engine cannot meet the request's deadline (predicted TTFT > deadline, or
    the engine is unhealthy): degrade to the other engine if allowed and it can, shed only after."""

    enabled: bool = True
    degrade: bool = True             # default for rules that do not say
    upgrade: bool = False            # may overflow move small -> large (costs more)? never after a budget downgrade
    degrade_pinned: bool = False     # may overflow move a request whose client named the engine?
    shed: bool = True                # nobody can meet the deadline: shed (503); false: keep the engine, admission decides


@dataclass(slots=True, frozen=True)
class Policy:
    engines: EngineRoles
    prices: dict[str, Prices]
    version: int = SCHEMA_VERSION
    description: str = ""
    default_priority: str = "interactive"
    router: RouterSettings = field(default_factory=RouterSettings)
    rules: tuple[Rule, ...] = ()
    rate_classes: dict[str, RateClass] = field(default_factory=dict)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    overflow: Overflow = field(default_factory=Overflow)
    batch_price_percent: int = DEFAULT_BATCH_PRICE_PERCENT

    def tenant(self, name: str) -> TenantPolicy:
        """The tenant's entry, else the "*" entry, else an empty one (no budget, deployment limits)."""
        found = self.tenants.get(name)
        if found is None:
            found = self.tenants.get(DEFAULT_TENANT)
        return found if found is not None else TenantPolicy()

    def context_for(self, tenant: str, rule_index: int | None) -> ContextLimit | None:
        """The context limit in force: the matching rule's, else the tenant's, else none."""
        if rule_index is not None and self.rules[rule_index].action.context is not None:
            return self.rules[rule_index].action.context
        return self.tenant(tenant).context

    def fallback_for(self, tenant: str, rule_index: int | None) -> Fallback | None:
        """The fallback chain in force: the matching rule's, else the tenant's, else none."""
        if rule_index is not None and self.rules[rule_index].action.fallback is not None:
            return self.rules[rule_index].action.fallback
        return self.tenant(tenant).fallback

    def weight_of(self, tenant: str) -> int:
        return self.tenant(tenant).weight

    def rate_class_for(self, tenant: str) -> RateClass | None:
        name = self.tenant(tenant).rate_class
        return self.rate_classes.get(name) if name is not None else None
