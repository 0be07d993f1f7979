"""Which of N engines serves a prompt, given each engine's P(good) for it and what each costs.

Two policies (both pure, both on numpy arrays ordered like the engines):

  cheapest_good_enough(p, cost, quality_target)
      the cheapest engine whose P(good) >= quality_target; when none reaches it, the engine with
      the highest P(good) (the cheaper one on a tie): a target no engine reaches buys the best guess,
      not the most expensive engine.
  best_under_cost_cap(p, cost, lam)
      argmax over engines of P(good) - lam * cost (the cheaper one on a tie): lam is the price of
      one unit of cost in quality. A cap on the mean cost per request becomes a lam on calibration
      prompts (`lam_for_cost_cap`, from the artifact's table), so every prompt trades quality for
      cost at the same rate: the most expected quality for that mean cost (the Lagrangian of
      "maximise sum P(good) subject to sum cost <= cap").

Costs are relative (any positive unit); with two engines and cost (0, 1), best_under_cost_cap is
"large when P(large good) - P(small good) > lam", the expected-gain rule.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def cheapest_good_enough(p: np.ndarray, cost: np.ndarray, quality_target: float) -> int:
    if not 0.0 <= quality_target <= 1.0:
        raise ValueError(f"quality_target must lie in [0, 1], got {quality_target!r}")
    order = np.lexsort((np.arange(cost.size), cost))          # by cost, then by position
    for i in order:
        if p[i] >= quality_target:
            return int(i)
    best = p.max()
    return int(next(i for i in order if p[i] == best))


def best_under_cost_cap(p: np.ndarray, cost: np.ndarray, lam: float) -> int:
    value = p - lam * cost
    best = value.max()
    order = np.lexsort((np.arange(cost.size), cost))
    return int(next(i for i in order if value[i] == best))


def choose_all(P: np.ndarray, cost: np.ndarray, quality_target: float | None = None,
               lam: float | None = None) -> np.ndarray:
    """The engine index per row of P (prompts x engines), by exactly one of the two policies;
    the same choices as the one-prompt functions, vectorised (numpy's argmax takes the first
    maximum, so columns go in cost order)."""
    order = np.lexsort((np.arange(cost.size), cost))
    Q = P[:, order]
    if lam is not None and quality_target is None:
        return order[np.argmax(Q - lam * cost[order], axis=1)]
    if quality_target is None or lam is not None:
        raise ValueError("give exactly one of quality_target and lam")
    if not 0.0 <= quality_target <= 1.0:
        raise ValueError(f"quality_target must lie in [0, 1], got {quality_target!r}")
    ok = Q >= quality_target
    return order[np.where(ok.any(axis=1), np.argmax(ok, axis=1), np.argmax(Q, axis=1))]


def lam_grid(P: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Every lam at which some prompt's choice can change (pairwise break-even points), plus the
    ends: between two consecutive values every prompt's choice is fixed."""
    points = [0.0]
    for a in range(cost.size):
        for b in range(cost.size):
            if cost[b] > cost[a]:
                points.extend(((P[:, b] - P[:, a]) / (cost[b] - cost[a])).tolist())
    g = np.unique(np.clip(np.asarray(points), 0.0, None))
    return np.append(g, g[-1] + 1.0)


def cost_table(P: np.ndarray, cost: np.ndarray, points: int = 201) -> list[list[float]]:
    """[[lam, mean cost], ...] for lams spanning the choices on these (calibration) prompts,
    mean cost non-increasing in lam; at most `points` rows (evenly spaced in the grid)."""
    grid = lam_grid(P, cost)
    if grid.size > points:
        grid = grid[np.unique(np.linspace(0, grid.size - 1, points).round().astype(np.int64))]
    # just above each break-even point, where the choice there has settled
    lams = np.nextafter(grid, np.inf)
    out = [[float(lam), float(cost[choose_all(P, cost, lam=lam)].mean())] for lam in lams]
    for i in range(1, len(out)):                    # ties broken by position keep it monotone already;
        out[i][1] = min(out[i][1], out[i - 1][1])   # this guards the float edge cases
    return out


def lam_for_cost_cap(table: Sequence[Sequence[float]], cap: float) -> float:
    """The smallest lam whose mean cost on the calibration prompts is at most `cap` (the most
    quality within the cap); above every entry's cost, the first lam; below all, the last."""
    if not cap >= 0.0:
        raise ValueError(f"cost_cap must be a number >= 0, got {cap!r}")
    for lam, mean_cost in table:
        if mean_cost <= cap + 1e-12:
            return float(lam)
    return float(table[-1][0])
