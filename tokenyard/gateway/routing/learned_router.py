"""Model "auto" through the learned router, with the interim rule as the fallback.

Deployment YAML (all keys optional; without `router.artifact` nothing changes):

    router:
      artifact: ../tokenyard/router_models/artifacts/demo_router.json  # relative to the YAML file
      target_large_share: 0.3    # overrides the artifact's calibrated threshold (0..1), or
      threshold: null            # a raw score threshold (0..1); at most one of the two
      small: demo-small          # default: routing.small
      large: demo-large          # default: routing.large
      # an N-engine artifact (format version 2) instead: tokenyard/gateway/routing/engine_set_router.py
      quality_target: null       # cheapest engine whose P(good) >= this (0..1), or
      cost_cap: null             # the best engines for this mean relative cost per call
      engines: null              # deployment engines for the artifact's, in its order

Per request, tokenyard/gateway/http/route_plan.py scores the prompt once it is tokenised with the counting
engine and picks with `LearnedRouter.engine_for(score)`; `route_auto` does both in one call for
tools and benchmarks:

    decision = route_auto(gw.learned_router, gw.router, prompt_text(req.messages), len(ids))
    # decision.engine, decision.reason ("router" or the interim "auto:..."), decision.score

`route_auto` with no learned router (no `router.artifact` configured) is exactly the interim rule
of tokenyard/gateway/routing/interim_rule.py (`Router.auto(prompt_tokens)`), with score None. The artifact is loaded
once at start-up (`LearnedRouter.from_settings`); a missing, old or tampered file fails the
start with `ArtifactError`'s message, never a request. Scoring is pure: text features, a dot
product, no I/O, no engine calls.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from tokenyard.gateway.routing.decision import RouterDecision, RouterSettings
from tokenyard.gateway.routing.engine_set_router import EngineSetRouter
from tokenyard.gateway.routing.interim_rule import Router
from tokenyard.policies.adapter_access import ADAPTER_NAME
from tokenyard.policies.evaluate import small_is_enough
from tokenyard.router_models.runtime.artifact import ArtifactError
from tokenyard.router_models.runtime.engine_set import EngineSet, load_router
from tokenyard.router_models.runtime.features import prompt_text
from tokenyard.router_models.runtime.scorer import Scorer

REASON = "router"
__all__ = ["REASON", "RouterSettings", "RouterDecision", "LearnedRouter", "EngineSetRouter", "route_auto",
           "parse_router_settings", "prompt_text", "ArtifactError"]


class LearnedRouter:
    def __init__(self, scorer: Scorer, small: str, large: str) -> None:
        self.scorer = scorer
        self.small = small
        self.large = large

    @property
    def engines(self) -> list[str]:
        """The engines "auto" routes among, cheapest first."""
        return [self.small, self.large]

    @classmethod
    def from_settings(cls, settings: RouterSettings, small: str | None = None,
                      large: str | None = None) -> "LearnedRouter | EngineSetRouter | None":
        """None when no artifact is configured (the interim rule stays in charge); an
        EngineSetRouter for an N-engine (format version 2) artifact."""
        if settings.artifact is None:
            return None
        found = load_router(settings.artifact)
        if isinstance(found, EngineSet):
            return EngineSetRouter.from_artifact(found, settings, settings.deployment_engines or found.names)
        if settings.quality_target is not None or settings.cost_cap is not None or settings.engines is not None:
            raise ValueError("router.quality_target, router.cost_cap and router.engines need an N-engine artifact "
                             "(format version 2); this one is a two-engine artifact: use router.threshold or "
                             "router.target_large_share")
        small, large = settings.small or small, settings.large or large
        if small is None or large is None:
            raise ValueError("router: a learned router needs a small and a large engine "
                             "(router.small/router.large or routing.small/routing.large)")
        scorer = Scorer(found, threshold=settings.threshold, target_large_share=settings.target_large_share)
        return cls(scorer, small, large)

    @property
    def threshold(self) -> float:
        return self.scorer.threshold

    def engine_for(self, score: float, threshold: float | None = None) -> str:
        """The engine for a score; `threshold` overrides the calibrated one for this request only."""
        cut = self.scorer.threshold if threshold is None else threshold
        return self.small if small_is_enough(score, cut) else self.large

    def decide(self, text: str, prompt_tokens: int, threshold: float | None = None) -> RouterDecision:
        """Score and pick in one call (benchmarks and tools; the gateway scores once in http/route_plan.py)."""
        score = self.scorer.score(text, prompt_tokens)
        return RouterDecision(self.engine_for(score, threshold), REASON, score)


def route_auto(learned: LearnedRouter | EngineSetRouter | None, interim: Router, text: str, prompt_tokens: int,
               threshold: float | None = None) -> RouterDecision:
    if learned is None:
        route = interim.auto(prompt_tokens)
        return RouterDecision(route.engine, route.reason, None)
    if isinstance(learned, EngineSetRouter):
        return learned.decide(text, prompt_tokens)
    return learned.decide(text, prompt_tokens, threshold)


# The keys of the deployment's `router:` section (deployment.KNOWN_KEYS lists them for the docs test).
ROUTER_KEYS = frozenset({"artifact", "target_large_share", "threshold", "small", "large", "quality_target", "cost_cap",
                         "engines"})


def parse_router_settings(data: Any, base_dir: Path, engines: Mapping[str, Any]) -> RouterSettings:
    """The `router:` section of the deployment file; errors name the key path."""
    if data is None:
        return RouterSettings()
    if not isinstance(data, dict):
        raise ValueError("router must be a mapping")
    extra = set(data) - ROUTER_KEYS
    if extra:
        raise ValueError(f"router: unknown keys {', '.join(sorted(map(str, extra)))}")
    out = RouterSettings(deployment_engines=list(engines))
    if data.get("artifact") is not None:
        if not isinstance(data["artifact"], str):
            raise ValueError("router.artifact must be a path")
        path = Path(data["artifact"])
        out.artifact = path if path.is_absolute() else (base_dir / path).resolve()
    for key in ("target_large_share", "threshold", "quality_target", "cost_cap"):
        value = data.get(key)
        if value is None:
            continue
        top = None if key == "cost_cap" else 1
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
                or (top is not None and value > top)):
            raise ValueError(f"router.{key} must be a number in [0, 1], got {value!r}" if top is not None
                             else f"router.{key} must be a number >= 0, got {value!r}")
        setattr(out, key, float(value))
    if out.target_large_share is not None and out.threshold is not None:
        raise ValueError("router: set target_large_share or threshold, not both")
    if out.quality_target is not None and out.cost_cap is not None:
        raise ValueError("router: set quality_target or cost_cap, not both")
    if data.get("engines") is not None:
        names = data["engines"]
        if not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) for n in names):
            raise ValueError("router.engines must be a list of at least two engine names")
        # ENGINE:ADAPTER routes to one of an engine's LoRA adapters (loaded at start-up or at run time)
        unknown = [n for n in names if n.partition(":")[0] not in engines
                   or (":" in n and not ADAPTER_NAME.match(n.partition(":")[2]))]
        if unknown:
            raise ValueError(f"router.engines names {', '.join(map(repr, unknown))}, not under engines "
                             f"(an engine name, or ENGINE:ADAPTER of one)")
        if len(set(names)) != len(names):
            raise ValueError("router.engines lists an engine twice")
        out.engines = list(names)
    for key in ("small", "large"):
        value = data.get(key)
        if value is not None and value not in engines:
            raise ValueError(f"router.{key} names engine {value!r}, which is not under engines")
        setattr(out, key, value)
    return out
