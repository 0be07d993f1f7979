"""The N-engine router: one artifact holding, for each engine, a model of P(that engine's answer is
good | prompt), and the policy that turns those into a choice (tokenyard/router_models/runtime/selection.py).

    {"format": "tokenyard-router", "format_version": 2,
     "feature_spec": {...FeatureSpec...},                   # one feature row serves every engine
     "model": {"kind": "per_engine_logistic", "positive": "engine_good",
               "engines": [{"name": "demo-small", "cost": 1.0, "intercept": b,
                            "indices": [...], "values": [...]}, ...]},   # cheapest first
     "selection": {"method": "quality_target" | "cost_cap", "quality_target": t | null,
                   "cost_cap": c | null, "lam": l | null},   # the calibrated default
     "calibration": {"prompts": n, "cost_table": [[lam, mean cost], ...],
                     "quantiles": [...], ...},             # of P(the cheapest engine is good)
     "training": {...provenance...},
     "checksum": "sha256:..."}

Format version 1 (the two-engine P(small is enough) artifact, artifact.py) is untouched: `load_router`
reads either and returns an `Artifact` for version 1, an `EngineSet` for version 2. Costs are
relative per call (the engines' price ratio at training time); a deployment may pass its own.
Refusals are `ArtifactError`s naming the file and the problem, as for version 1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from tokenyard.router_models.runtime.artifact import FORMAT, Artifact, ArtifactError, checked_spec, checksum
from tokenyard.router_models.runtime.artifact import from_json as v1_from_json
from tokenyard.router_models.runtime.features import FeatureSpec, Weights, compiled, row
from tokenyard.router_models.runtime.selection import choose_all, lam_for_cost_cap

FORMAT_VERSION = 2
MODEL_KIND = "per_engine_logistic"
METHODS = ("quality_target", "cost_cap")
_KEYS = {"format", "format_version", "feature_spec", "model", "selection", "calibration", "training", "checksum"}


@dataclass(slots=True)
class EngineModel:
    name: str
    cost: float                     # relative cost of one call
    intercept: float
    indices: list[int]
    values: list[float]


@dataclass(slots=True)
class EngineSet:
    spec: FeatureSpec
    engines: list[EngineModel]      # in cost order, cheapest first
    method: str                     # the default selection: "quality_target" or "cost_cap"
    quality_target: float | None
    cost_cap: float | None
    cost_table: list[list[float]]   # [[lam, mean cost on calibration], ...], lam increasing
    calibration_prompts: int
    # Calibration quantiles of P(the cheapest engine is good), the decision's scalar router_score,
    # as a version-1 artifact keeps its score's: a policy's router.target_large_share becomes a
    # threshold on that score for the what-if replay, which sees only router_score.
    quantiles: list[float]
    training: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)   # extra calibration figures (provenance)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.engines]

    def to_json(self) -> dict[str, Any]:
        lam = None if self.cost_cap is None else lam_for_cost_cap(self.cost_table, self.cost_cap)
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, "feature_spec": self.spec.to_dict(),
                "model": {"kind": MODEL_KIND, "positive": "engine_good",
                          "engines": [{"name": e.name, "cost": e.cost, "intercept": e.intercept,
                                       "indices": list(e.indices), "values": list(e.values)} for e in self.engines]},
                "selection": {"method": self.method, "quality_target": self.quality_target,
                              "cost_cap": self.cost_cap, "lam": lam},
                "calibration": {**self.calibration, "prompts": self.calibration_prompts,
                                "cost_table": self.cost_table, "quantiles": self.quantiles},
                "training": self.training}
        body["checksum"] = checksum(body)
        return body


class EngineScorer:
    """P(good) of every engine for one prompt, from one feature row: the same numbers as each
    engine's scikit-learn predict_proba (to 1e-9; tests/router/test_router_engines.py)."""

    def __init__(self, es: EngineSet, costs: Sequence[float] | None = None, quality_target: float | None = None,
                 cost_cap: float | None = None) -> None:
        self.engine_set = es
        self.artifact = es              # as Scorer.artifact: its `quantiles` serve router.target_large_share
        self.spec = es.spec
        self.names = es.names
        self.W = np.zeros((len(es.engines), es.spec.dim), dtype=np.float64)
        for k, e in enumerate(es.engines):
            self.W[k, np.asarray(e.indices, dtype=np.int64)] = np.asarray(e.values, dtype=np.float64)
        self.b = np.array([e.intercept for e in es.engines], dtype=np.float64)
        self._b = self.b.tolist()
        self._WT = Weights(self.W.T)     # one row per column: the row sums each block's columns for all engines
        compiled(self.spec)             # builds or loads the C row kernel now, not on the first request
        self.costs = np.array([e.cost for e in es.engines] if costs is None else costs, dtype=np.float64)
        if self.costs.shape != (len(es.engines),) or not np.all(self.costs > 0) or not np.all(np.isfinite(self.costs)):
            raise ValueError(f"engine costs must be {len(es.engines)} positive numbers, got {list(self.costs)}")
        self._order = np.lexsort((np.arange(self.costs.size), self.costs))     # cheapest first, then position
        self.quality_target, self.lam = es.quality_target, None
        if es.method == "cost_cap" and es.cost_cap is not None:
            self.lam = lam_for_cost_cap(es.cost_table, es.cost_cap)
        self.set_selection(quality_target, cost_cap)

    def set_selection(self, quality_target: float | None = None, cost_cap: float | None = None) -> None:
        """Override the artifact's default (a deployment or a policy); both None keeps it."""
        if quality_target is not None and cost_cap is not None:
            raise ValueError("give a quality_target or a cost_cap, not both")
        if quality_target is not None:
            if not 0.0 <= quality_target <= 1.0:
                raise ValueError(f"quality_target must lie in [0, 1], got {quality_target!r}")
            self.quality_target, self.lam = float(quality_target), None
        elif cost_cap is not None:
            self.quality_target, self.lam = None, lam_for_cost_cap(self.engine_set.cost_table, cost_cap)

    def probabilities(self, text: str, tokens: int) -> np.ndarray:
        r = row(text, tokens, self.spec, self._WT)
        f0, f1, f2 = r.factors.tolist()
        p = []
        # a handful of engines: plain floats beat numpy's per-call cost
        for b, s0, s1, s2, dense in zip(self._b, *r.weight_sums().tolist()):
            z = b + dense + s0 * f0 + s1 * f1 + s2 * f2
            # the logistic function without overflow for large |z|
            p.append(1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z)))
        return np.array(p)

    def choose(self, p: np.ndarray, quality_target: float | None = None, cost_cap: float | None = None) -> int:
        """The engine index for these probabilities; quality_target / cost_cap override the
        scorer's selection for this call only."""
        if quality_target is not None or cost_cap is not None:
            lam = lam_for_cost_cap(self.engine_set.cost_table, cost_cap) if cost_cap is not None else None
            return int(choose_all(p[None, :], self.costs, quality_target if lam is None else None, lam)[0])
        if self.lam is not None:         # the rules of selection.py, without its per-call set-up
            return int(self._order[int(np.argmax((p - self.lam * self.costs)[self._order]))])
        for i in self._order:
            if p[i] >= self.quality_target:
                return int(i)
        return int(self._order[int(np.argmax(p[self._order]))])


def load_router(path: str | Path) -> Artifact | EngineSet:
    """Either artifact format: version 1 (two engines, artifact.py) or version 2 (N engines)."""
    path = Path(path)
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ArtifactError(f"router artifact {path}: cannot read it ({e.strerror})") from e
    except UnicodeDecodeError as e:
        raise ArtifactError(f"router artifact {path}: not UTF-8 text") from e
    except json.JSONDecodeError as e:
        raise ArtifactError(f"router artifact {path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    try:
        if isinstance(body, dict) and body.get("format") == FORMAT and body.get("format_version") == FORMAT_VERSION:
            return from_json(body)
        return v1_from_json(body)
    except ArtifactError as e:
        raise ArtifactError(f"router artifact {path}: {e}") from e


def save(es: EngineSet, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(es.to_json(), separators=(",", ":"), allow_nan=False) + "\n", encoding="utf-8")


def from_json(body: dict[str, Any]) -> EngineSet:
    spec = checked_spec(body, _KEYS)
    model, sel, cal = body["model"], body["selection"], body["calibration"]
    try:
        if model["kind"] != MODEL_KIND:
            raise ArtifactError(f"model kind {model['kind']!r} is not supported (expected {MODEL_KIND!r})")
        engines = [EngineModel(str(e["name"]), float(e["cost"]), float(e["intercept"]),
                               [int(i) for i in e["indices"]], [float(v) for v in e["values"]])
                   for e in model["engines"]]
        method = str(sel["method"])
        qt = None if sel["quality_target"] is None else float(sel["quality_target"])
        cap = None if sel["cost_cap"] is None else float(sel["cost_cap"])
        table = [[float(lam), float(c)] for lam, c in cal["cost_table"]]
        quantiles = [float(q) for q in cal["quantiles"]]
        es = EngineSet(spec, engines, method, qt, cap, table, int(cal["prompts"]), quantiles,
                       dict(body["training"]),
                       {k: v for k, v in cal.items() if k not in ("prompts", "cost_table", "quantiles")})
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ArtifactError):
            raise
        raise ArtifactError(f"malformed model/selection/calibration section ({type(e).__name__}: {e})") from e
    _check(es)
    return es


def _check(es: EngineSet) -> None:
    if len(es.engines) < 2:
        raise ArtifactError("an engine set needs at least two engines")
    names = es.names
    if len(set(names)) != len(names):
        raise ArtifactError(f"engine names must be unique, got {names}")
    costs = [e.cost for e in es.engines]
    if any(not (math.isfinite(c) and c > 0) for c in costs) or costs != sorted(costs):
        raise ArtifactError("engine costs must be positive numbers, cheapest engine first")
    for e in es.engines:
        if len(e.indices) != len(e.values) or len(set(e.indices)) != len(e.indices):
            raise ArtifactError(f"engine {e.name}: indices and values must be equally long, indices unique")
        if any(not 0 <= i < es.spec.dim for i in e.indices):
            raise ArtifactError(f"engine {e.name}: indices must lie in [0, {es.spec.dim}) for this feature spec")
        if not all(math.isfinite(v) for v in [*e.values, e.intercept]):
            raise ArtifactError(f"engine {e.name}: weights must be finite numbers")
    if es.method not in METHODS:
        raise ArtifactError(f"selection method {es.method!r} is not one of {', '.join(METHODS)}")
    if es.method == "quality_target" and (es.quality_target is None or not 0 <= es.quality_target <= 1):
        raise ArtifactError("selection quality_target must be a number in [0, 1]")
    if es.method == "cost_cap" and (es.cost_cap is None or not es.cost_cap >= 0):
        raise ArtifactError("selection cost_cap must be a number >= 0")
    if not es.cost_table or any(len(r) != 2 or not all(math.isfinite(x) for x in r) for r in es.cost_table):
        raise ArtifactError("calibration cost_table must be a non-empty list of [lam, mean cost] pairs")
    q = es.quantiles
    if len(q) < 2 or not all(math.isfinite(x) for x in q) or any(b < a for a, b in zip(q, q[1:])):
        raise ArtifactError("calibration quantiles must be at least two non-decreasing numbers")
