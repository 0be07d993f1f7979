"""Hyper-parameters chosen on the calibration split only: a grid of (protocol, label design, C,
cross weight), each point scored by the APGR of calibration scores from models that never saw
those prompts. Protocols (`train.cross_fit`): folds=0 fits on train and scores calibration;
folds=2 fits on train + the other calibration fold (out-of-fold scores). The test split is never
read here.

The two protocols' figures are not comparable with each other: under folds=2 the held-out fold's
unfamiliar wording (phrasing 3) is also in the fitted fold, so its scores see that wording
familiar; under folds=0 they do not. Within a protocol the points are comparable, and C and the
cross weight of the shipped protocol and labels are that cell's best point.

    python -m tokenyard.bench.router_select          # writes bench/results/router_select.json

Features are extracted once: the novelty vocabulary and the dense normalisation come from the
train split whatever the grid point, and the cross weight scales the cross block's columns
linearly (each block is scaled by weight / its L2 norm), so one matrix with weight 1 serves every
weight by a column scaling.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from tokenyard.router_models.runtime.features import matrix
from tokenyard.router_models.training.routing_metrics import bootstrap, routing_curve, summary
from tokenyard.router_models.training.train import DEFAULT_FOLDS, LABEL_DESIGNS, Labelled, cross_fit, prepare_spec

GRID_C = (0.3, 1.0, 3.0, 10.0)
GRID_CROSS_WEIGHT = (0.5, 1.0, 2.0, 4.0)


def _scaled(X, spec, weight: float):
    from scipy.sparse import diags

    scale = np.ones(spec.dim)
    scale[spec.n_dense + spec.word_dim + spec.char_dim:] = weight
    return (X @ diags(scale)).tocsr()


def _best(points: list[dict]) -> dict:
    return max(points, key=lambda p: (round(p["apgr"], 6), -p["cpt_95"]))


def select(train: Labelled, calibration: Labelled, labels: Sequence[str] = LABEL_DESIGNS,
           grid_c: Sequence[float] = GRID_C, grid_cross: Sequence[float] = GRID_CROSS_WEIGHT,
           protocols: Sequence[int] = (DEFAULT_FOLDS,), resamples: int = 300) -> dict[str, Any]:
    """Every grid point's held-out calibration APGR / CPT; per protocol, the best point of each
    label design (by APGR, ties: CPT(95%)) with a bootstrap interval, and the paired difference
    between the two designs' best points."""
    if calibration.small_correct is None or calibration.large_correct is None:
        raise ValueError("selection needs small_correct/large_correct in the calibration rows")
    spec = replace(prepare_spec(train), cross_weight=1.0)
    X_train = matrix(train.texts, train.tokens, spec)
    X_cal = matrix(calibration.texts, calibration.tokens, spec)
    small, large = calibration.small_correct, calibration.large_correct
    points = []
    scores_of: dict[tuple, np.ndarray] = {}
    for folds in protocols:
        for design in labels:
            for weight in grid_cross:
                Xt, Xc = _scaled(X_train, spec, weight), _scaled(X_cal, spec, weight)
                for C in grid_c:
                    _, held_out = cross_fit(train, calibration, replace(spec, cross_weight=weight), C, design, folds,
                                            X_train=Xt, X_cal=Xc, final=False)
                    curve = routing_curve(held_out, small, large)
                    points.append({"folds": folds, "labels": design, "C": C, "cross_weight": weight,
                                   **summary(curve)})
                    scores_of[(folds, design, C, weight)] = held_out
    out: dict[str, Any] = {"calibration_prompts": len(calibration), "train_prompts": len(train), "points": points,
                           "protocols": {}}
    for folds in protocols:
        best = {d: _best([p for p in points if p["folds"] == folds and p["labels"] == d]) for d in labels}
        cell: dict[str, Any] = {"best": best, "bootstrap": {}}
        for d, b in best.items():
            cell["bootstrap"][d] = bootstrap(scores_of[(folds, d, b["C"], b["cross_weight"])], small, large,
                                             resamples=resamples)
        if len(labels) == 2:
            a, b = (best[d] for d in labels)
            cell[f"{labels[1]}_minus_{labels[0]}"] = bootstrap(
                scores_of[(folds, labels[1], b["C"], b["cross_weight"])], small, large, resamples=resamples,
                baseline=scores_of[(folds, labels[0], a["C"], a["cross_weight"])])["difference_vs_baseline"]
        out["protocols"][str(folds)] = cell
    return out
