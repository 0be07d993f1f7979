"""Serving-time scoring: P(small is enough) for one prompt, from a loaded artifact, in numpy.

    scorer = Scorer(artifact.load(path))
    p = scorer.score(text, prompt_tokens)       # float in (0, 1)
    scorer.goes_large(p)                         # p < threshold (the artifact's, or an override)

The same number scikit-learn's `LogisticRegression.predict_proba(X)[:, 1]` gives for the row
`features.extract(text, tokens, spec)` (to 1e-9; tests/router/test_router_artifact.py), computed from
a dense float64 weight vector without building the row: per hashed block, the weights of its
n-gram occurrences summed and scaled once by the block's L2 factor (`features.row`).
"""
from __future__ import annotations

import math

import numpy as np

from tokenyard.router_models.runtime.artifact import Artifact
from tokenyard.router_models.runtime.calibration import threshold_from_quantiles
from tokenyard.router_models.runtime.features import Weights, compiled, row


class Scorer:
    def __init__(self, artifact: Artifact, threshold: float | None = None,
                 target_large_share: float | None = None) -> None:
        """threshold / target_large_share override the artifact's threshold (at most one)."""
        self.artifact = artifact
        self.spec = artifact.spec
        self.weights = np.zeros(artifact.spec.dim, dtype=np.float64)
        self.weights[np.asarray(artifact.indices, dtype=np.int64)] = np.asarray(artifact.values, dtype=np.float64)
        self.intercept = float(artifact.intercept)
        self._weights = Weights(self.weights)
        compiled(self.spec)             # builds or loads the C row kernel now, not on the first request
        self.threshold = artifact.threshold
        self.set_threshold(threshold, target_large_share)

    def set_threshold(self, threshold: float | None = None, target_large_share: float | None = None) -> float:
        """Override the calibrated threshold (a policy may do this); both None keeps the artifact's."""
        if threshold is not None and target_large_share is not None:
            raise ValueError("give a threshold or a target_large_share, not both")
        if threshold is not None:
            if not 0.0 <= threshold <= 1.0:
                raise ValueError(f"threshold must lie in [0, 1], got {threshold!r}")
            self.threshold = float(threshold)
        elif target_large_share is not None:
            self.threshold = threshold_from_quantiles(self.artifact.quantiles, target_large_share)
        return self.threshold

    def logit(self, text: str, tokens: int) -> float:
        # sum over occurrences of w[col] == sum over columns of count * w[col]; each block's L2
        # scaling is one factor (features.Row.factors); the row adds up each block's weights and
        # the dense dot product.
        r = row(text, tokens, self.spec, self._weights)
        f0, f1, f2 = r.factors.tolist()
        s0, s1, s2, dense = r.weight_sums()[:, 0].tolist()
        return self.intercept + dense + s0 * f0 + s1 * f1 + s2 * f2

    def score(self, text: str, tokens: int) -> float:
        z = self.logit(text, tokens)
        # The logistic function without overflow for large |z| (scipy's expit, in two halves).
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        e = math.exp(z)
        return e / (1.0 + e)

    def goes_large(self, score: float) -> bool:
        return score < self.threshold
