"""Quality against cost for N engines: the router's curves, random routing, the oracle, and the
RouteLLM numbers on a cost axis.

Cost axis: mean relative cost per call, normalised so 0 is "every call to the cheapest engine" and
1 is "every call to the most expensive one" (with two engines this is the share of large calls,
so APGR and CPT below equal the two-engine definitions in routing_metrics.py).
PGR: (accuracy - accuracy of the cheapest engine) / (accuracy of the priciest - of the cheapest).

Curves (points sorted by cost):
  cost_cap      the lam sweep of selection.best_under_cost_cap (every break-even lam on these
                prompts): the most expected quality for each mean cost; its last point (lam = 0,
                argmax P(good)) is joined to "everything to the priciest engine" by a straight line
                (a random mix of the two policies), so the curve spans the axis and APGR is defined.
                The points themselves, not their hull (as the two-engine threshold curve).
  quality_target  the sweep of selection.cheapest_good_enough over targets 0, 0.01, ..., 1.
  random        random routing among the engines: the upper convex hull of the single engines'
                points (with two engines the straight line, APGR 0.5).
  oracle        the lam sweep with the true outcomes as P(good).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tokenyard.router_models.runtime.selection import choose_all, lam_grid
from tokenyard.router_models.training.routing_metrics import Curve, apgr, cpt

TARGETS = np.round(np.linspace(0.0, 1.0, 101), 2)


def _norm(c: np.ndarray, cost: np.ndarray) -> np.ndarray:
    return (c - cost.min()) / (cost.max() - cost.min())


def _point(pick: np.ndarray, correct: np.ndarray, cost: np.ndarray) -> tuple[float, float]:
    return float(cost[pick].mean()), float(correct[np.arange(pick.size), pick].mean())


def _curve(points: list[tuple[float, float]], correct: np.ndarray, cost: np.ndarray) -> Curve:
    pts = sorted(set(points))
    c = _norm(np.array([p[0] for p in pts]), cost)
    q = np.array([p[1] for p in pts])
    return Curve(c, q, float(correct[:, 0].mean()), float(correct[:, -1].mean()))


def cost_cap_curve(P: np.ndarray, correct: np.ndarray, cost: np.ndarray, max_points: int = 2000) -> Curve:
    grid = lam_grid(P, cost)
    if grid.size > max_points:
        grid = grid[np.unique(np.linspace(0, grid.size - 1, max_points).round().astype(np.int64))]
    pts = [_point(choose_all(P, cost, lam=float(lam)), correct, cost) for lam in np.nextafter(grid, np.inf)]
    pts.append(_point(np.zeros(len(P), dtype=np.int64), correct, cost))                 # all cheapest
    pts.append(_point(np.full(len(P), cost.size - 1, dtype=np.int64), correct, cost))   # all priciest
    return _curve(pts, correct, cost)


def _frontier(curve: Curve) -> Curve:
    """The upper concave hull of the points (any point on it is a random mix of two policies)."""
    keep: list[int] = []
    for i in range(curve.share.size):
        while len(keep) >= 2:
            a, b = keep[-2], keep[-1]
            cross = ((curve.share[b] - curve.share[a]) * (curve.quality[i] - curve.quality[a])
                     - (curve.quality[b] - curve.quality[a]) * (curve.share[i] - curve.share[a]))
            if cross >= 0:
                keep.pop()
            else:
                break
        keep.append(i)
    return Curve(curve.share[keep], curve.quality[keep], curve.quality_small, curve.quality_large)


def quality_target_curve(P: np.ndarray, correct: np.ndarray, cost: np.ndarray) -> Curve:
    pts = [_point(choose_all(P, cost, quality_target=float(t)), correct, cost) for t in TARGETS]
    return _curve(pts, correct, cost)


def random_curve(correct: np.ndarray, cost: np.ndarray) -> Curve:
    singles = [(float(cost[k]), float(correct[:, k].mean())) for k in range(cost.size)]
    return _frontier(_curve(singles, correct, cost))


def summary(curve: Curve, spans: bool = True) -> dict[str, Any]:
    """APGR (only for a curve spanning the cost axis) and CPT(50/80/95%) as normalised cost."""
    out: dict[str, Any] = {f"cpt_{int(t * 100)}": cpt(curve, t) for t in (0.5, 0.8, 0.95)}
    out["apgr"] = apgr(curve) if spans else None
    out["max_quality"] = float(curve.quality.max())
    return out


def evaluate_engines(P: np.ndarray, correct: np.ndarray, cost: np.ndarray, names: list[str],
                     quality_target: float | None = None) -> tuple[dict[str, Any], dict[str, Curve]]:
    """The report and the curves for scores P (prompts x engines, cost order) on labelled prompts."""
    curves = {"cost_cap": cost_cap_curve(P, correct, cost), "quality_target": quality_target_curve(P, correct, cost),
              "random": random_curve(correct, cost), "oracle": cost_cap_curve(correct.astype(np.float64), correct, cost)}
    report: dict[str, Any] = {
        "prompts": int(len(P)), "engines": names, "costs": cost.tolist(),
        "accuracy": dict(zip(names, correct.mean(0).tolist())),
        "normalised_cost": dict(zip(names, _norm(cost, cost).tolist())),
        "cost_cap": summary(curves["cost_cap"]), "quality_target": summary(curves["quality_target"], spans=False),
        "random": summary(curves["random"]), "oracle": summary(curves["oracle"]),
        "curves": {k: {"cost": c.share.round(5).tolist(), "quality": c.quality.round(5).tolist()}
                   for k, c in curves.items()},
    }
    if quality_target is not None:
        pick = choose_all(P, cost, quality_target=quality_target)
        c, q = _point(pick, correct, cost)
        report["at_quality_target"] = {"target": quality_target, "normalised_cost": float(_norm(np.array([c]), cost)[0]),
                                       "accuracy": q, "share": dict(zip(names, (np.bincount(pick, minlength=cost.size)
                                                                         / len(pick)).tolist()))}
    return report, curves
