"""Threshold calibration: turn a cost target (share of large calls) or a quality target into
the score threshold, from the scores of a held-out calibration split.

Convention everywhere: a prompt goes to the large engine when score < threshold, where score is
P(small is enough). So the share of large calls is the share of scores below the threshold.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

QUANTILE_POINTS = 201   # quantiles kept in the artifact: shares 0, 0.5%, ..., 100%


def threshold_for_large_share(scores: Sequence[float], share: float) -> float:
    """The threshold that sends `share` of these scores to the large engine (ties may round)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"target large share must lie in [0, 1], got {share!r}")
    s = np.sort(np.asarray(scores, dtype=np.float64))
    if s.size == 0:
        raise ValueError("no calibration scores")
    k = int(round(share * s.size))
    if k <= 0:
        return float(s[0])                          # nothing scores below the minimum
    if k >= s.size:
        return float(np.nextafter(s[-1], np.inf))   # everything scores below
    return float((s[k - 1] + s[k]) / 2)


def score_quantiles(scores: Sequence[float], points: int = QUANTILE_POINTS) -> list[float]:
    """q[i]: the threshold that sends share i/(points-1) of the scores to the large engine."""
    return [threshold_for_large_share(scores, i / (points - 1)) for i in range(points)]


def threshold_from_quantiles(quantiles: Sequence[float], share: float) -> float:
    """Threshold for a target large share from the artifact's quantile table (linear between
    points), so a policy can set a share at serving time without the calibration data."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"target large share must lie in [0, 1], got {share!r}")
    pos = share * (len(quantiles) - 1)
    i = min(int(pos), len(quantiles) - 2)
    frac = pos - i
    return float(quantiles[i] + frac * (quantiles[i + 1] - quantiles[i]))


def large_share(scores: Sequence[float], threshold: float) -> float:
    s = np.sort(np.asarray(scores, dtype=np.float64))
    return bisect.bisect_left(s.tolist(), threshold) / max(1, s.size)
