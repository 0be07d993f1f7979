"""Model "auto" over N engines: a format-version-2 router artifact (tokenyard/router_models/runtime/engine_set.py)
scores each engine's P(good) for the prompt, and the selection picks the cheapest engine whose
P(good) reaches the quality target, or the best one under a cost cap.

Deployment YAML (tokenyard/gateway/routing/learned_router.py parses it; the same `router:` section as the
two-engine router):

    router:
      artifact: ../tokenyard/router_models/artifacts/demo_router_3.json
      quality_target: 0.6      # or cost_cap: 0.4 (mean cost per call, relative: the artifact's
                               # engine costs); neither keeps the artifact's calibrated default
      engines: [demo-small, demo-medium, demo-large]   # deployment engines for the artifact's
                               # engines, in the artifact's (cost) order; default: the same names

The decision's `score` (the x-tokenyard-router-score header, the metrics histogram and the usage
record's router_score) is P(the cheapest engine is good): with two engines and P(good) models this
plays the part of P(small is enough). `scores` has every engine's P(good).
"""
from __future__ import annotations

from tokenyard.gateway.routing.decision import RouterDecision, RouterSettings
from tokenyard.router_models.runtime.engine_set import EngineScorer, EngineSet

REASON = "router"


class EngineSetRouter:
    def __init__(self, scorer: EngineScorer, engines: list[str]) -> None:
        if len(engines) != len(scorer.names):
            raise ValueError(f"router.engines lists {len(engines)} engines; the artifact has {len(scorer.names)} "
                             f"({', '.join(scorer.names)})")
        self.scorer = scorer
        self.engines = list(engines)
        self.small, self.large = self.engines[0], self.engines[-1]   # cheapest and priciest

    @classmethod
    def from_artifact(cls, es: EngineSet, settings: RouterSettings,
                      deployment_engines: list[str]) -> "EngineSetRouter":
        if settings.threshold is not None or settings.target_large_share is not None:
            raise ValueError("router.threshold and router.target_large_share belong to a two-engine artifact; "
                             "this artifact routes among several engines: use router.quality_target or "
                             "router.cost_cap")
        if settings.small is not None or settings.large is not None:
            raise ValueError("router.small and router.large belong to a two-engine artifact; this artifact "
                             "names its engines (map them with router.engines)")
        engines = settings.engines or es.names
        unknown = [e for e in engines if e not in deployment_engines]
        if unknown:
            raise ValueError(f"router: the artifact's engines {', '.join(unknown)} are not under engines "
                             "(name them with router.engines)")
        scorer = EngineScorer(es, quality_target=settings.quality_target, cost_cap=settings.cost_cap)
        return cls(scorer, engines)

    @property
    def threshold(self) -> None:
        """No score threshold: the selection is a quality target or a cost cap."""
        return None

    def decide(self, text: str, prompt_tokens: int, quality_target: float | None = None,
               cost_cap: float | None = None) -> RouterDecision:
        p = self.scorer.probabilities(text, prompt_tokens)
        pick = self.scorer.choose(p, quality_target, cost_cap)
        return RouterDecision(self.engines[pick], REASON, float(p[0]), dict(zip(self.engines, p.tolist())))
