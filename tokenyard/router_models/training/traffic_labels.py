"""Labels from the operator's traffic (clients' feedback, judges' verdicts) as training data for the
router, beside or instead of the demo labels. Pure: the caller reads the labels (from Redis,
tokenyard/cli/router.py) and passes them in.

    rows = label_rows(labels)          # the labels that teach something: {prompt, prompt_tokens, label}
    train, cal, info = traffic_training_set(rows, demo_train, demo_cal, weight=8)   # combined with the demo
    train, cal, info = traffic_training_set(rows, None, None)                       # traffic alone
    agreement(scorer_fn, rows)         # share of the rows whose label a router's decision matches

Combined (the default): the traffic rows join the demo train split, each `weight` times (the
operator's own traffic outweighs a generic label set, so a family of prompts flips after tens of
labels, not hundreds: bench/RESULTS.md, "Learning from traffic"); the threshold is still calibrated
on the demo calibration split, so the share of large calls keeps its meaning. Traffic alone: a
stable hash of each prompt holds out 25% for calibration (train.hash_split); it needs both labels
among the rows and is only sensible with hundreds of labels across the tenant's whole traffic.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from tokenyard.router_models.training.train import Labelled, concat, from_rows, hash_split

DEFAULT_TRAFFIC_WEIGHT = 8


def label_rows(labels: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The labels with a 0/1 training label, as training rows (a label of null teaches nothing)."""
    out = []
    for v in labels:
        if v.get("label") in (0, 1) and isinstance(v.get("prompt"), str):
            out.append({"prompt": v["prompt"], "prompt_tokens": int(v.get("prompt_tokens") or 0),
                        "label": int(v["label"])})
    return out


def traffic_training_set(rows: Sequence[dict[str, Any]], demo_train: Labelled | None, demo_cal: Labelled | None,
                         weight: int = DEFAULT_TRAFFIC_WEIGHT) -> tuple[Labelled, Labelled, dict[str, Any]]:
    if not rows:
        raise ValueError("no traffic labels with a 0/1 label to train on")
    if weight < 1:
        raise ValueError(f"traffic weight must be an integer >= 1, got {weight}")
    info: dict[str, Any] = {"traffic_labels": len(rows), "traffic_label_1": sum(r["label"] for r in rows)}
    if demo_train is None or demo_cal is None:
        train, cal = hash_split(from_rows(list(rows), "traffic"))
        if len(cal) < 2:
            raise ValueError(f"only {len(cal)} traffic prompts held out for calibration; traffic alone needs more "
                             "labels (or combine them with the demo labels)")
        return train, cal, {**info, "base": "none"}
    extra = from_rows(list(rows) * weight, "traffic")
    return concat(demo_train, extra), demo_cal, {**info, "base": "demo", "traffic_weight": weight}


def agreement(goes_large: Callable[[str, int], bool], rows: Sequence[dict[str, Any]]) -> float | None:
    """Share of rows whose label the decision matches (label 1: small; label 0: large)."""
    if not rows:
        return None
    hits = sum(int(goes_large(r["prompt"], r["prompt_tokens"]) == (r["label"] == 0)) for r in rows)
    return hits / len(rows)
