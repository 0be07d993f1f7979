"""Quality against cost for a routing score, and the RouteLLM summary numbers.

A router orders prompts by score (P(small is enough)); sending the k lowest-scoring prompts to
the large engine and the rest to the small one gives one point of the curve
    share of large calls = k / n,   quality = mean correctness of the engine each prompt got.
Points are taken only between distinct scores, so tied prompts move together and the straight
line between two points is the expected quality under random tie-breaking.

PGR (performance gap recovered) at a point = (quality - q_small) / (q_large - q_small).
APGR = the area under PGR against share of large calls over [0, 1] (trapezoids; random routing
gives exactly 0.5). CPT(x) = the smallest share of large calls at which PGR reaches x (linear
between points). Definitions follow RouteLLM (Ong et al., 2024), section 4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tokenyard.router_models.runtime.calibration import threshold_for_large_share


@dataclass(slots=True)
class Curve:
    share: np.ndarray       # share of large calls, 0 .. 1, non-decreasing
    quality: np.ndarray     # accuracy at that share
    quality_small: float    # everything to the small engine
    quality_large: float    # everything to the large engine

    @property
    def gap(self) -> float:
        return self.quality_large - self.quality_small

    def pgr(self) -> np.ndarray:
        return (self.quality - self.quality_small) / self.gap if self.gap > 0 else np.zeros_like(self.quality)


def routing_curve(scores: np.ndarray, small_correct: np.ndarray, large_correct: np.ndarray) -> Curve:
    scores = np.asarray(scores, dtype=np.float64)
    small = np.asarray(small_correct, dtype=np.float64)
    large = np.asarray(large_correct, dtype=np.float64)
    n = scores.size
    if n == 0:
        raise ValueError("no prompts to evaluate")
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    gain = (large - small)[order]                    # what moving one prompt to large changes
    cum = np.concatenate([[0.0], np.cumsum(gain)])   # k prompts moved: quality = (sum small + cum[k]) / n
    ks = np.concatenate([[0], np.nonzero(np.diff(s))[0] + 1, [n]])
    base = small.sum()
    return Curve(ks / n, (base + cum[ks]) / n, float(small.mean()), float(large.mean()))


def oracle_scores(small_correct: np.ndarray, large_correct: np.ndarray) -> np.ndarray:
    """Perfect labels as scores: prompts only the large engine gets right go large first, prompts
    only the small engine gets right go large last."""
    small = np.asarray(small_correct, dtype=bool)
    large = np.asarray(large_correct, dtype=bool)
    return np.where(~small & large, 0.0, np.where(small & ~large, 1.0, 0.5))


def random_curve(quality_small: float, quality_large: float) -> Curve:
    """Random routing in expectation: a straight line between the two single models."""
    return Curve(np.array([0.0, 1.0]), np.array([quality_small, quality_large]), quality_small, quality_large)


def apgr(curve: Curve) -> float:
    pgr = curve.pgr()
    return float(np.sum((pgr[1:] + pgr[:-1]) / 2 * np.diff(curve.share)))


def cpt(curve: Curve, target: float) -> float:
    """Smallest share of large calls reaching `target` PGR (nan if never reached)."""
    pgr = curve.pgr()
    hit = np.nonzero(pgr >= target - 1e-12)[0]
    if hit.size == 0:
        return float("nan")
    i = int(hit[0])
    if i == 0:
        return float(curve.share[0])
    p0, p1, s0, s1 = pgr[i - 1], pgr[i], curve.share[i - 1], curve.share[i]
    return float(s0 + (target - p0) / (p1 - p0) * (s1 - s0))


def at_threshold(scores: np.ndarray, small_correct: np.ndarray, large_correct: np.ndarray,
                 threshold: float) -> dict[str, float]:
    """Share of large calls and quality when routing large below `threshold`."""
    large_mask = np.asarray(scores) < threshold
    quality = np.where(large_mask, np.asarray(large_correct, float), np.asarray(small_correct, float)).mean()
    return {"threshold": float(threshold), "large_share": float(large_mask.mean()), "quality": float(quality)}


def summary(curve: Curve, targets: tuple[float, ...] = (0.5, 0.8, 0.95)) -> dict:
    return {"apgr": apgr(curve), **{f"cpt_{int(round(t * 100))}": cpt(curve, t) for t in targets},
            "max_quality": float(curve.quality.max())}


def threshold_for_quality(scores: Sequence[float], small_correct: Sequence[bool], large_correct: Sequence[bool],
                          target_pgr: float) -> float:
    """The threshold with the fewest large calls whose calibration quality recovers at least
    `target_pgr` of the gap between the small and the large model (1.0: all of it)."""
    scores = np.asarray(scores, dtype=np.float64)
    curve = routing_curve(scores, np.asarray(small_correct, float), np.asarray(large_correct, float))
    gap = curve.quality_large - curve.quality_small
    if gap <= 0:
        return threshold_for_large_share(scores, 0.0)
    pgr = (curve.quality - curve.quality_small) / gap
    hit = np.nonzero(pgr >= target_pgr - 1e-12)[0]
    share = float(curve.share[hit[0]]) if hit.size else 1.0
    return threshold_for_large_share(scores, share)


def bootstrap(scores: np.ndarray, small_correct: np.ndarray, large_correct: np.ndarray, resamples: int = 1000,
              seed: int = 0, targets: tuple[float, ...] = (0.8, 0.95), level: float = 0.95,
              baseline: np.ndarray | None = None) -> dict[str, Any]:
    """Percentile bootstrap confidence intervals for APGR and CPT(target): prompts resampled with
    replacement, the curve (and the single-model qualities in it) recomputed on each resample.
    With `baseline` (another router's scores on the same prompts), also the interval of the paired
    difference APGR(scores) - APGR(baseline) and CPT differences, on the same resamples.
    A CPT a resample never reaches counts as 1.0 (all calls large)."""
    scores = np.asarray(scores, dtype=np.float64)
    small = np.asarray(small_correct, dtype=np.float64)
    large = np.asarray(large_correct, dtype=np.float64)
    n = scores.size
    rng = np.random.default_rng(seed)
    names = ["apgr", *(f"cpt_{int(round(t * 100))}" for t in targets)]
    draws: dict[str, list[float]] = {k: [] for k in names}
    diffs: dict[str, list[float]] = {k: [] for k in names}

    def stats(s: np.ndarray, idx: np.ndarray) -> list[float]:
        curve = routing_curve(s[idx], small[idx], large[idx])
        out = [apgr(curve)]
        for t in targets:
            c = cpt(curve, t)
            out.append(1.0 if np.isnan(c) else c)
        return out

    for _ in range(resamples):
        idx = rng.integers(0, n, size=n)
        mine = stats(scores, idx)
        for k, v in zip(names, mine):
            draws[k].append(v)
        if baseline is not None:
            for k, v, b in zip(names, mine, stats(np.asarray(baseline, dtype=np.float64), idx)):
                diffs[k].append(v - b)
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    out: dict[str, Any] = {"resamples": resamples, "level": level, "seed": seed}
    for k in names:
        out[k] = [float(np.percentile(draws[k], lo)), float(np.percentile(draws[k], hi))]
    if baseline is not None:
        out["difference_vs_baseline"] = {k: [float(np.percentile(diffs[k], lo)), float(np.percentile(diffs[k], hi))]
                                         for k in names}
    return out
