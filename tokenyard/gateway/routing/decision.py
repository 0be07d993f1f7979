"""The learned router's deployment settings and its per-request decision (shared by the
two-engine LearnedRouter and the N-engine EngineSetRouter; parsed in learned_router.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class RouterSettings:
    artifact: Path | None = None
    target_large_share: float | None = None
    threshold: float | None = None
    small: str | None = None
    large: str | None = None
    quality_target: float | None = None     # N-engine artifacts only (engine_set_router.py)
    cost_cap: float | None = None
    engines: list[str] | None = None
    deployment_engines: list[str] = field(default_factory=list)   # every engine of the deployment


@dataclass(slots=True, frozen=True)
class RouterDecision:
    engine: str
    reason: str                 # "router", or the interim rule's reason when no artifact is configured
    score: float | None         # P(small is enough); None without the learned router
    scores: dict[str, float] | None = None   # N-engine router: every engine's P(good)
