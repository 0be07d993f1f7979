"""Train the N-engine router: per engine, a logistic regression of P(its answer is good | prompt)
on one shared feature row; calibrate the selection on the calibration split.

    data = engine_labels(DATA, {"demo-medium": DATA / "engines" / "demo-medium.jsonl"})
    es = train_engine_set(data["train"], data["calibration"], costs={"demo-small": 1, ...})

Labels: the suite label files (tokenyard/demo/router_labels.py) give the pair's outcomes (`small_correct`,
`large_correct`, under the manifest's engine names); every further engine comes from a file of
{"id", "correct"} lines (tokenyard/bench/router_third_engine.py label), joined by id. The feature spec
(novelty vocabulary, dense normalisation) comes from the train split, as for the two-engine
router (train.prepare_spec), and each engine's model uses the same C (train.DEFAULT_C).

Calibration (no test data): the cost table (mean cost per lam, selection.cost_table) from the
calibration prompts' scores, and the default quality target: on a 0.01 grid, the target whose
calibration routing reaches `target_pgr` of the accuracy gap between the cheapest and the most
expensive engine at the lowest mean cost (ties: the higher target).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from tokenyard.router_models.runtime.calibration import score_quantiles
from tokenyard.router_models.runtime.engine_set import EngineModel, EngineSet
from tokenyard.router_models.runtime.features import matrix
from tokenyard.router_models.runtime.selection import choose_all, cost_table
from tokenyard.router_models.training.train import DEFAULT_C, Labelled, fit_matrix, from_rows, prepare_spec, read_jsonl

SPLITS = ("train", "calibration", "test")
TARGET_GRID = np.round(np.linspace(0.0, 1.0, 101), 2)


@dataclass(slots=True)
class EngineLabels:
    names: list[str]
    texts: list[str]
    tokens: list[int]
    correct: np.ndarray                         # prompts x engines, bool
    meta: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.texts)

    def as_labelled(self) -> Labelled:
        """The texts and counts as a two-engine Labelled (feature fitting reads only those)."""
        return Labelled(self.texts, self.tokens, self.correct[:, 0].astype(np.int64), meta=self.meta)


def engine_labels(folder: str | Path, extra: Mapping[str, str | Path], small: str | None = None,
                  large: str | None = None, train_items: int | None = None) -> dict[str, EngineLabels]:
    """Per split, the pair's outcomes and those of every engine in `extra` (name -> file);
    `train_items`: the first N train rows only (an extra engine labelled on fewer)."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text()) if (folder / "manifest.json").is_file() else {}
    small = small or Path(manifest.get("small", {}).get("model", "small")).name
    large = large or Path(manifest.get("large", {}).get("model", "large")).name
    found: dict[str, dict[str, bool]] = {}
    for name, path in extra.items():
        found[name] = {}
        for n, r in enumerate(read_jsonl(path), 1):
            if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("correct"), bool):
                raise ValueError(f"{path}:{n}: expected {{\"id\": text, \"correct\": true/false}}")
            found[name][r["id"]] = r["correct"]
    names = [small, large, *extra]
    if len(set(names)) != len(names):
        raise ValueError(f"engine names must be unique, got {names}")
    out = {}
    for split in SPLITS:
        rows = read_jsonl(folder / f"{split}.jsonl")
        if split == "train" and train_items is not None:
            rows = rows[:train_items]
        base = from_rows(rows, str(folder / f"{split}.jsonl"))
        cols = [base.small_correct, base.large_correct]
        for name in extra:
            missing = [r["id"] for r in rows if r["id"] not in found[name]]
            if missing:
                raise ValueError(f"engine {name}: no outcome for {len(missing)} {split} prompts (first: {missing[0]})")
            cols.append(np.array([found[name][r["id"]] for r in rows], dtype=bool))
        out[split] = EngineLabels(names, base.texts, base.tokens, np.stack(cols, axis=1).astype(bool), base.meta)
    return out


def order_by_cost(data: EngineLabels, costs: Mapping[str, float]) -> EngineLabels:
    """The same labels with engine columns in cost order (cheapest first), as the artifact keeps them."""
    missing = [n for n in data.names if n not in costs]
    if missing:
        raise ValueError(f"no cost for engines {missing}")
    idx = sorted(range(len(data.names)), key=lambda k: (costs[data.names[k]], k))
    return EngineLabels([data.names[k] for k in idx], data.texts, data.tokens, data.correct[:, idx], data.meta)


def fit_engines(train: EngineLabels, C: float = DEFAULT_C, spec=None):
    """(spec, one fitted LogisticRegression per engine column)."""
    spec = prepare_spec(train.as_labelled(), spec)
    X = matrix(train.texts, train.tokens, spec)
    return spec, [fit_matrix(X, train.correct[:, k].astype(np.float64), C) for k in range(len(train.names))]


def probabilities(models, spec, data: EngineLabels) -> np.ndarray:
    """P(good) per prompt and engine through scikit-learn (training and evaluation)."""
    X = matrix(data.texts, data.tokens, spec)
    return np.stack([m.predict_proba(X)[:, 1] for m in models], axis=1)


def routed_quality(P: np.ndarray, correct: np.ndarray, cost: np.ndarray, **policy) -> tuple[float, float]:
    """(mean cost, accuracy) of routing these prompts by one selection policy."""
    pick = choose_all(P, cost, **policy)
    return float(cost[pick].mean()), float(correct[np.arange(len(pick)), pick].mean())


def target_for_pgr(P: np.ndarray, correct: np.ndarray, cost: np.ndarray, target_pgr: float) -> float:
    """The quality target reaching `target_pgr` of the cheapest-to-priciest gap on these prompts
    at the lowest mean cost; the highest target when none does."""
    q_lo, q_hi = correct[:, 0].mean(), correct[:, -1].mean()
    best = None
    for t in TARGET_GRID:
        c, q = routed_quality(P, correct, cost, quality_target=float(t))
        if q >= q_lo + target_pgr * (q_hi - q_lo) - 1e-12 and (best is None or c <= best[0]):
            best = (c, float(t))
    return best[1] if best is not None else float(TARGET_GRID[-1])


def train_engine_set(train: EngineLabels, calibration: EngineLabels, costs: Mapping[str, float],
                     C: float = DEFAULT_C, target_pgr: float = 0.95, cost_cap: float | None = None,
                     training: dict[str, Any] | None = None) -> tuple[EngineSet, list]:
    """The artifact (default selection: the calibrated quality target, or `cost_cap` when given)
    and the fitted models."""
    train, calibration = order_by_cost(train, costs), order_by_cost(calibration, costs)
    if calibration.names != train.names:
        raise ValueError("train and calibration must label the same engines")
    cost = np.array([float(costs[n]) for n in train.names])
    spec, models = fit_engines(train, C)
    P = probabilities(models, spec, calibration)
    table = cost_table(P, cost)
    target = target_for_pgr(P, calibration.correct, cost, target_pgr)
    engines = [EngineModel(name, float(c), float(m.intercept_[0]), [int(i) for i in np.nonzero(m.coef_[0])[0]],
                           [float(v) for v in m.coef_[0][np.nonzero(m.coef_[0])[0]]])
               for name, c, m in zip(train.names, cost, models)]
    cal_c, cal_q = routed_quality(P, calibration.correct, cost, quality_target=target)
    meta = {"classifier": f"sklearn LogisticRegression(C={C}, lbfgs) per engine", "C": C,
            "train_prompts": len(train), "accuracy_train": dict(zip(train.names, train.correct.mean(0).tolist())),
            **(training or {})}
    cal_info = {"accuracy": dict(zip(train.names, calibration.correct.mean(0).tolist())),
                "target_pgr": target_pgr, "at_default_target": {"mean_cost": cal_c, "accuracy": cal_q}}
    es = EngineSet(spec, engines, "cost_cap" if cost_cap is not None else "quality_target", target, cost_cap,
                   table, len(calibration), score_quantiles(P[:, 0]), meta, cal_info)
    return es, models
