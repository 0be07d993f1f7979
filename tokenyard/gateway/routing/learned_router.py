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

from tokenyard.gateway.routing.decision import RouterDecision, RouterSettings
from tokenyard.gateway.routing.engine_set_router import EngineSetRouter
from tokenyard.gateway.routing.interim_rule import Router
from tokenyard.policies.evaluate import small_is_enough
from tokenyard.router_models.runtime.artifact import ArtifactError
from tokenyard.router_models.runtime.engine_set import EngineSet, load_router
from tokenyard.router_models.runtime.features import prompt_text
from tokenyard.router_models.runtime.scorer import Scorer

REASON = "router"
__all__ = ["REASON", "RouterSettings", "RouterDecision", "LearnedRouter", "EngineSetRouter", "route_auto",
           "prompt_text", "ArtifactError"]


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


