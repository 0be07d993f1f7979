"""The learned router on its held-out test split: overall and by wording, with bootstrap intervals,
against the ceilings, and against the issue-12 design retrained on the same data.

    .venv/bin/python -m tokenyard.bench.router_eval [--artifact tokenyard/router_models/artifacts/demo_router.json]
                                          [--labels tokenyard/router_models/data] [--resamples 1000]

Overall figures are `tokenyard router eval`'s (tokenyard.router_models.training.evaluation.evaluate), with
95% percentile-bootstrap intervals for APGR and CPT. Added here:
- by wording: familiar phrasings (0-2: the demo models and the router trained on them) and the
  unseen wording (4-5: nothing ever trained or calibrated on it), each subset with its own
  single-model qualities and intervals;
- ceilings: the per-prompt oracle (perfect outcomes, bounds everything); a table told each
  prompt's task, level and whether its wording is familiar, with each group's expected gain
  fitted on the calibration split (out of sample: what routing on those facts can reach); and
  the same table fitted on the test split itself (in sample, an upper bound for those facts);
- designs, all retrained here on the same data and features with their own C and cross weight
  (each protocol and label design's best calibration point in bench/results/router_select.json),
  each with the paired bootstrap difference from the shipped artifact: fitted on train only or on
  train + calibration (so on phrasing 3's unfamiliar wording, 2-fold cross-fitted calibration),
  with "small is enough" or expected-gain labels.
Raw output: bench/results/router_eval.json (the curves stay in bench/router_eval.json).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from tokenyard.bench.results_io import RunRecorder
from tokenyard.router_models.runtime.artifact import Artifact, load
from tokenyard.router_models.runtime.features import FeatureSpec
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.evaluation import TARGETS, evaluate, score_all
from tokenyard.router_models.training.routing_metrics import at_threshold, bootstrap, oracle_scores, routing_curve, summary
from tokenyard.router_models.training.train import Labelled, load_labels, train_router

ROOT = Path(__file__).resolve().parent.parent.parent
SELECT = ROOT / "bench" / "results" / "router_select.json"
FAMILIAR = (0, 1, 2)             # tokenyard.demo.task_suite.TRAIN_PHRASINGS: the demo models trained on these


def _familiar(meta: dict) -> bool:
    return meta["phrasing"] in FAMILIAR


def told_scores(fit_on: Labelled, score: Labelled, keys: tuple[str, ...] = ("task", "level")) -> np.ndarray:
    """Each prompt of `score` scored by minus the mean gain (large correct - small correct) of its
    group (keys + familiar wording or not) in `fit_on`; a group `fit_on` lacks gets the overall mean."""
    def group(m: dict) -> tuple:
        return (*(m[k] for k in keys), _familiar(m))
    gain = fit_on.large_correct.astype(float) - fit_on.small_correct.astype(float)
    sums: dict[tuple, list[float]] = defaultdict(list)
    for m, g in zip(fit_on.meta, gain):
        sums[group(m)].append(g)
    means = {k: float(np.mean(v)) for k, v in sums.items()}
    overall = float(gain.mean())
    return np.array([-means.get(group(m), overall) for m in score.meta])


def _subset(test: Labelled, scores: np.ndarray, mask: np.ndarray, resamples: int) -> dict:
    sub = test.subset(mask)
    curve = routing_curve(scores[mask], sub.small_correct, sub.large_correct)
    out = {"prompts": int(mask.sum()), "quality_small": curve.quality_small, "quality_large": curve.quality_large,
           **summary(curve, TARGETS)}
    if resamples:
        out["ci95"] = bootstrap(scores[mask], sub.small_correct, sub.large_correct, resamples=resamples)
    return out


def _chosen(folds: int, labels: str) -> dict:
    """C and cross weight of this protocol and label design's best calibration point
    (bench/results/router_select.json), so every design runs with its own chosen values."""
    best = json.loads(SELECT.read_text())["figures"]["protocols"][str(folds)]["best"][labels]
    return {"C": best["C"], "cross_weight": best["cross_weight"]}


def _design(art: Artifact, train: Labelled, cal: Labelled, folds: int, labels: str) -> tuple[Artifact, dict]:
    hyper = _chosen(folds, labels)
    spec = FeatureSpec(cross_weight=hyper["cross_weight"], window=art.spec.window)
    return train_router(train, cal, C=hyper["C"], labels=labels, folds=folds, spec=spec,
                        target_large_share=art.threshold_target)[0], hyper


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"))
    ap.add_argument("--labels", default=str(ROOT / "tokenyard" / "router_models" / "data"),
                    help="folder with train, calibration and test.jsonl")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--no-baselines", action="store_true", help="skip retraining the other designs")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    rec = RunRecorder("router_eval")
    folder = Path(args.labels)
    art = load(args.artifact)
    test = load_labels(folder / "test.jsonl")
    cal = load_labels(folder / "calibration.jsonl")
    report, _ = evaluate(art, test, resamples=args.resamples)
    scores = score_all(Scorer(art), test)
    small, large = test.small_correct, test.large_correct
    familiar = np.array([_familiar(m) for m in test.meta])
    wordings = {"familiar (0-2)": familiar, "unseen (4-5)": ~familiar}
    by_wording = {name: _subset(test, scores, mask, args.resamples) for name, mask in wordings.items()}
    oracle = oracle_scores(small, large)
    ceilings = {
        "oracle": report["oracle"],
        "oracle_by_wording": {name: _subset(test, oracle, mask, 0) for name, mask in wordings.items()},
        "told_task_level_familiarity_out_of_sample": summary(routing_curve(told_scores(cal, test), small, large),
                                                             TARGETS),
        "told_task_level_familiarity_in_sample": summary(routing_curve(told_scores(test, test), small, large),
                                                         TARGETS),
    }
    designs = {}
    if not args.no_baselines:
        train = load_labels(folder / "train.jsonl")
        for folds, labels in ((2, "expected_gain"), (2, "small_enough"), (0, "expected_gain"), (0, "small_enough")):
            if (folds, labels) == (art.training["folds"], art.training["labels"]):
                continue
            name = f"{'train + calibration (2 folds)' if folds else 'train only'}, {labels}"
            other_art, hyper = _design(art, train, cal, folds, labels)
            other = score_all(Scorer(other_art), test)
            curve = routing_curve(other, small, large)
            designs[name] = {**hyper, **summary(curve, TARGETS),
                             "calibrated": at_threshold(other, small, large, other_art.threshold),
                             "by_wording": {w: summary(routing_curve(other[m], small[m], large[m]), TARGETS)
                                            for w, m in wordings.items()},
                             "shipped_minus_this_ci95": bootstrap(scores, small, large, resamples=args.resamples,
                                                                  baseline=other)["difference_vs_baseline"]
                             if args.resamples else None}
    figures = {"test_prompts": report["test_prompts"], "quality_small": report["quality_small"],
               "quality_large": report["quality_large"], "router": report["router"],
               "router_ci95": report["router_ci95"], "random": report["random"], "calibrated": report["calibrated"],
               "router_by_wording": by_wording, "ceilings": ceilings, "designs": designs,
               "artifact_training": art.training,
               # random routing sends the same share large: a straight line between the two models
               "random_quality_at_calibrated_share": report["quality_small"] + report["calibrated"]["large_share"]
               * (report["quality_large"] - report["quality_small"])}
    runs = [{"task": t, **v} for t, v in report["by_task"].items()]
    ci = report["router_ci95"] or {}
    print(f"test prompts {report['test_prompts']}: small {report['quality_small']:.3f}, large {report['quality_large']:.3f}")
    rows = [("router", report["router"]), ("random", report["random"]), ("oracle", ceilings["oracle"]),
            ("told task/level/familiar, out of sample", ceilings["told_task_level_familiarity_out_of_sample"]),
            ("told task/level/familiar, in sample", ceilings["told_task_level_familiarity_in_sample"]),
            *designs.items()]
    for name, s in rows:
        print(f"{name:52s} APGR {s['apgr']:.3f}  CPT(50%) {s['cpt_50']:.3f}  CPT(80%) {s['cpt_80']:.3f}  "
              f"CPT(95%) {s['cpt_95']:.3f}  best {s['max_quality']:.3f}")
    if ci:
        print(f"router 95% CI: APGR [{ci['apgr'][0]:.3f}, {ci['apgr'][1]:.3f}], CPT(95%) [{ci['cpt_95'][0]:.3f}, "
              f"{ci['cpt_95'][1]:.3f}]")
    for name, s in by_wording.items():
        c = s.get("ci95", {})
        print(f"router, {name:16s} n={s['prompts']} small {s['quality_small']:.3f} large {s['quality_large']:.3f} "
              f"APGR {s['apgr']:.3f} {c.get('apgr', '')} CPT(95%) {s['cpt_95']:.3f} {c.get('cpt_95', '')} "
              f"oracle APGR {ceilings['oracle_by_wording'][name]['apgr']:.3f}")
    for name, d in designs.items():
        if d["shipped_minus_this_ci95"]:
            diff = d["shipped_minus_this_ci95"]
            print(f"shipped - [{name}]: APGR [{diff['apgr'][0]:+.3f}, {diff['apgr'][1]:+.3f}], "
                  f"CPT(95%) [{diff['cpt_95'][0]:+.3f}, {diff['cpt_95'][1]:+.3f}]; its 30% target gives "
                  f"{d['calibrated']['large_share']:.3f} large calls on test")
    c = report["calibrated"]
    print(f"calibrated: target {c['target']} -> large share {c['large_share']:.3f}, quality {c['quality']:.3f} "
          f"(random at that share {figures['random_quality_at_calibrated_share']:.3f})")
    if not args.no_results:
        rec.write(figures, runs, artifact=_rel(Path(args.artifact)), labels=_rel(folder))
    return 0


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
