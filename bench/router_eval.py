"""The learned router on its held-out test split: overall, by phrasing, and against a router told
each prompt's task, level and phrasing.

    .venv/bin/python -m bench.router_eval [--artifact router_models/artifacts/demo_router.json]
                                          [--test router_models/data/test.jsonl]

Overall figures are `tokenyard router eval`'s (router_models.training.evaluation.evaluate). Added here:
- by phrasing: the same APGR / CPT on the familiar phrasings (0-2, seen in training) and on the
  held-out phrasing (3, never trained on), each subset with its own single-model qualities;
- the told oracle: every prompt scored by the share of its (task, level, phrasing) group on the
  test split itself for which the small model is enough (label 1). It knows more than any
  router from prompt features can (the group's outcomes on this very split), so its APGR is an
  upper bound for routing on those three facts; the per-prompt oracle (perfect labels) bounds
  everything.
Raw output: bench/results/router_eval.json (the curves stay in bench/router_eval.json).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import numpy as np

from bench.results_io import RunRecorder
from router_models.runtime.artifact import load
from router_models.runtime.scorer import Scorer
from router_models.training.evaluation import TARGETS, evaluate, score_all
from router_models.training.routing_metrics import oracle_scores, routing_curve, summary
from router_models.training.train import Labelled, load_labels

ROOT = Path(__file__).resolve().parent.parent
HELD_OUT_PHRASING = 3            # demo.task_suite.HELD_OUT_PHRASING: never in the training split


def told_scores(test: Labelled, keys: tuple[str, ...] = ("task", "level", "phrasing")) -> np.ndarray:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, m in enumerate(test.meta):
        groups[tuple(m[k] for k in keys)].append(i)
    scores = np.zeros(len(test))
    for idx in groups.values():
        scores[idx] = test.labels[idx].mean()
    return scores


def _subset_summary(test: Labelled, scores: np.ndarray, mask: np.ndarray) -> dict:
    sub = test.subset(mask)
    curve = routing_curve(scores[mask], sub.small_correct, sub.large_correct)
    return {"prompts": int(mask.sum()), "quality_small": curve.quality_small, "quality_large": curve.quality_large,
            **summary(curve, TARGETS)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(ROOT / "router_models" / "artifacts" / "demo_router.json"))
    ap.add_argument("--test", default=str(ROOT / "router_models" / "data" / "test.jsonl"))
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    rec = RunRecorder("router_eval")
    art = load(args.artifact)
    test = load_labels(args.test)
    report, _ = evaluate(art, test)
    scores = score_all(Scorer(art), test)
    phrasing = np.array([m["phrasing"] for m in test.meta])
    by_phrasing = {"familiar (0-2)": _subset_summary(test, scores, phrasing != HELD_OUT_PHRASING),
                   "held-out (3)": _subset_summary(test, scores, phrasing == HELD_OUT_PHRASING)}
    told = told_scores(test)
    told_curve = routing_curve(told, test.small_correct, test.large_correct)
    oracle_by_phrasing = {
        name: _subset_summary(test, oracle_scores(test.small_correct, test.large_correct), mask)
        for name, mask in (("familiar (0-2)", phrasing != HELD_OUT_PHRASING),
                           ("held-out (3)", phrasing == HELD_OUT_PHRASING))}
    figures = {"test_prompts": report["test_prompts"], "quality_small": report["quality_small"],
               "quality_large": report["quality_large"], "router": report["router"], "random": report["random"],
               "oracle": report["oracle"], "calibrated": report["calibrated"],
               "router_by_phrasing": by_phrasing, "oracle_by_phrasing": oracle_by_phrasing,
               "told_task_level_phrasing": summary(told_curve, TARGETS),
               # random routing sends the same share large: a straight line between the two models
               "random_quality_at_calibrated_share": report["quality_small"] + report["calibrated"]["large_share"]
               * (report["quality_large"] - report["quality_small"])}
    runs = [{"task": t, **v} for t, v in report["by_task"].items()]
    for name, s in (("router", figures["router"]), ("random", figures["random"]), ("oracle", figures["oracle"]),
                    ("told task/level/phrasing", figures["told_task_level_phrasing"])):
        print(f"{name:26s} APGR {s['apgr']:.3f}  CPT(50%) {s['cpt_50']:.3f}  CPT(80%) {s['cpt_80']:.3f}  "
              f"CPT(95%) {s['cpt_95']:.3f}  best {s['max_quality']:.3f}")
    for name, s in by_phrasing.items():
        print(f"router, {name:16s} n={s['prompts']} small {s['quality_small']:.3f} large {s['quality_large']:.3f} "
              f"APGR {s['apgr']:.3f} CPT(95%) {s['cpt_95']:.3f}")
    c = report["calibrated"]
    print(f"calibrated: target {c['target']} -> large share {c['large_share']:.3f}, quality {c['quality']:.3f} "
          f"(random at that share {figures['random_quality_at_calibrated_share']:.3f})")
    if not args.no_results:
        rec.write(figures, runs, artifact=str(Path(args.artifact).resolve().relative_to(ROOT)),
                  test=str(Path(args.test).resolve().relative_to(ROOT)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
