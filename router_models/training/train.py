"""Train the router: labelled prompts -> logistic regression -> calibrated artifact.

    rows = load_labels("router_models/data/train.jsonl")
    art, clf = train_router(rows_train, rows_calibration, target_large_share=0.3)

Label files are JSONL with at least `prompt` (text), `label` (1: the small engine is enough, 0:
the large one is needed) and `prompt_tokens` (the serving tokenizer's count; the CLI fills it in
for operator files that lack it). Suite label files (demo/router_labels.py) also carry
`small_correct` / `large_correct`, which evaluation and quality targets need.

Reproducible: features are hashed with crc32, lbfgs has no random state and runs on one BLAS
thread, so on one machine the same rows give bit-identical artifacts. Another CPU (same wheels)
may pick other BLAS kernels, which sum in another order; lbfgs then stops a hair away, so the
weights agree to ~1e-4 and the scores to ~1e-5, not bit for bit (the tolerances and the
measurements behind them are in tests/test_router_training.py).
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from router_models.runtime.artifact import Artifact
from router_models.runtime.calibration import score_quantiles, threshold_for_large_share
from router_models.runtime.features import FeatureSpec, fit_normalisation, matrix
from router_models.training.routing_metrics import threshold_for_quality

DEFAULT_C = 1.0
DEFAULT_TARGET_LARGE_SHARE = 0.3


@dataclass(slots=True)
class Labelled:
    texts: list[str]
    tokens: list[int]
    labels: np.ndarray                          # 1: small is enough
    small_correct: np.ndarray | None = None
    large_correct: np.ndarray | None = None
    meta: list[dict[str, Any]] = field(default_factory=list)   # task/level/phrasing when known

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, mask: np.ndarray) -> "Labelled":
        idx = np.nonzero(mask)[0]
        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]
        return Labelled([self.texts[i] for i in idx], [self.tokens[i] for i in idx], self.labels[idx],
                        pick(self.small_correct), pick(self.large_correct),
                        [self.meta[i] for i in idx] if self.meta else [])


def from_rows(rows: Sequence[dict[str, Any]], source: str = "rows") -> Labelled:
    texts, tokens, labels, small, large, meta = [], [], [], [], [], []
    has_outcomes = all("small_correct" in r and "large_correct" in r for r in rows)
    for n, r in enumerate(rows, 1):
        try:
            text, label, count = r["prompt"], int(r["label"]), int(r["prompt_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: row {n} needs prompt, label and prompt_tokens ({e})") from e
        if not isinstance(text, str) or label not in (0, 1) or count < 0:
            raise ValueError(f"{source}: row {n}: prompt must be text, label 0 or 1, prompt_tokens >= 0")
        texts.append(text)
        tokens.append(count)
        labels.append(label)
        if has_outcomes:
            small.append(bool(r["small_correct"]))
            large.append(bool(r["large_correct"]))
        meta.append({k: r[k] for k in ("task", "level", "phrasing") if k in r})
    return Labelled(texts, tokens, np.array(labels, dtype=np.int64),
                    np.array(small, bool) if has_outcomes else None,
                    np.array(large, bool) if has_outcomes else None, meta)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
    return rows


def load_labels(path: str | Path) -> Labelled:
    return from_rows(read_jsonl(path), str(path))


def hash_split(data: Labelled, calibration_share: float = 0.25) -> tuple[Labelled, Labelled]:
    """Operator traffic has no calibration split: a stable hash of the prompt text picks one."""
    buckets = np.array([zlib.crc32(t.encode("utf-8")) % 1000 for t in data.texts])
    cal = buckets < int(calibration_share * 1000)
    return data.subset(~cal), data.subset(cal)


def fit(train: Labelled, spec: FeatureSpec | None = None,
        C: float = DEFAULT_C) -> tuple[LogisticRegression, FeatureSpec]:
    if len(set(train.labels.tolist())) < 2:
        raise ValueError("training labels must contain both classes (0 and 1)")
    spec = fit_normalisation(spec or FeatureSpec(), train.texts, train.tokens)
    X = matrix(train.texts, train.tokens, spec)
    clf = LogisticRegression(C=C, solver="lbfgs", max_iter=5000, tol=1e-8)
    # One BLAS/OpenMP thread: the same bits run after run on this machine (a thread count that
    # follows the machine would change the summation order), and 30x faster than two threads
    # fighting other work on a shared 2-core box (1.1 s vs 36 s measured for the demo set).
    with threadpool_limits(1):
        clf.fit(X, train.labels)
    return clf, spec


def predict(clf: LogisticRegression, spec: FeatureSpec, data: Labelled) -> np.ndarray:
    """P(small is enough) per prompt, through scikit-learn (training and evaluation)."""
    return clf.predict_proba(matrix(data.texts, data.tokens, spec))[:, 1]


def build_artifact(clf: LogisticRegression, spec: FeatureSpec, calibration: Labelled,
                   target_large_share: float | None = DEFAULT_TARGET_LARGE_SHARE,
                   target_quality: float | None = None, training: dict[str, Any] | None = None) -> Artifact:
    """Calibrate the threshold on `calibration` (a share of large calls, or a PGR target)."""
    scores = predict(clf, spec, calibration)
    if target_quality is not None:
        if calibration.small_correct is None:
            raise ValueError("a quality target needs small_correct/large_correct in the calibration rows")
        threshold = threshold_for_quality(scores, calibration.small_correct, calibration.large_correct,
                                          target_quality)
        method, target = "quality", float(target_quality)
    else:
        share = DEFAULT_TARGET_LARGE_SHARE if target_large_share is None else target_large_share
        threshold = threshold_for_large_share(scores, share)
        method, target = "large_share", float(share)
    coef = clf.coef_[0]
    nz = np.nonzero(coef)[0]
    return Artifact(spec, float(clf.intercept_[0]), [int(i) for i in nz], [float(coef[i]) for i in nz],
                    float(min(max(threshold, 0.0), 1.0)), method, target, score_quantiles(scores),
                    len(calibration), dict(training or {}))


def train_router(train: Labelled, calibration: Labelled, C: float = DEFAULT_C,
                 target_large_share: float | None = DEFAULT_TARGET_LARGE_SHARE, target_quality: float | None = None,
                 spec: FeatureSpec | None = None, training: dict[str, Any] | None = None
                 ) -> tuple[Artifact, LogisticRegression]:
    clf, spec = fit(train, spec, C)
    meta = {"classifier": f"sklearn LogisticRegression(C={C}, lbfgs)", "train_prompts": len(train),
            "train_label_1_share": float(train.labels.mean()), **(training or {})}
    return build_artifact(clf, spec, calibration, target_large_share, target_quality, meta), clf
