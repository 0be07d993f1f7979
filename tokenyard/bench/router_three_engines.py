"""The router with three engines (issue 28): demo-small, a third engine and demo-large on the
router's test split, on one cost-quality plot with random routing.

    python -m tokenyard.bench.router_three_engines                     # third engine demo-medium (cost 2)
    python -m tokenyard.bench.router_three_engines --third demo-large-int4 --third-cost 2 \
        --results-name router_three_engines_large_int4        # the large model with int4 weights

The third engine's outcomes come from `python -m tokenyard.bench.router_third_engine label` (a demo model
between the pair's sizes, or a checkpoint served with other weights).

1. Train the N-engine artifact (tokenyard/router_models/training/train_engines.py) on the train split, with
   the issue-12 feature settings (train.DEFAULT_C, cross weight 2), calibrate on the calibration
   split (the cost table; the default quality target reaching 95% of the small-to-large accuracy
   gap at the lowest mean cost there), and write tokenyard/router_models/artifacts/demo_router_3*.json.
   The same training restricted to the pair (small, large) gives the two-engine P(good) router.
2. Score the test split with the numpy scorer (the serving path) and report, on the normalised
   cost axis of engine_curves.py (0: every call small, 1: every call large): APGR and CPT of the
   lam sweep (best under a cost cap), the quality-target sweep, random routing among the three
   (hull of the single engines) and the oracle; the shipped two-engine router (demo_router.json,
   P(small is enough) with a threshold) on the same prompts, whose share of large calls is this
   axis; percentile-bootstrap 95% intervals (prompts resampled) for the three-engine APGR and CPT.
3. The decision cost per request (score every engine and choose; CPU time of the deciding thread,
   features included), as p50/p99 over the test prompts, against the two-engine router's (score
   and threshold): a second pass of each, interleaved.

Costs per call are relative: demo-small 1, demo-large 5 (tokenyard/deploy/default.yaml prices the pair 5x
apart, input and output alike); the third engine's cost is --third-cost (default 2: demo-medium
decodes about twice the small one's work per token; the int4 large model decodes 2.6-3.1x faster
than bf16 at batch 1, bench/RESULTS.md "Weight-only quantisation", so about 2 as well).
Writes bench/results/NAME.json, bench/NAME.png and the artifact.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from tokenyard.bench.results_io import RunRecorder
from tokenyard.router_models.runtime.artifact import load as load_v1
from tokenyard.router_models.runtime.engine_set import EngineScorer, save
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.engine_curves import cost_cap_curve, evaluate_engines
from tokenyard.router_models.training.routing_metrics import apgr, cpt, routing_curve, summary
from tokenyard.router_models.training.train_engines import EngineLabels, engine_labels, order_by_cost, train_engine_set

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"
ARTIFACTS = ROOT / "tokenyard" / "router_models" / "artifacts"
PAIR_COSTS = {"demo-small": 1.0, "demo-large": 5.0}


def _numpy_scores(scorer: EngineScorer, data: EngineLabels) -> tuple[np.ndarray, np.ndarray]:
    """P(good) per prompt and engine, and the deciding thread's CPU time per decision (score +
    choose) in ms (as tokenyard/bench/router_latency.py reports it: wall time adds descheduling on a shared box)."""
    P, ms = [], []
    for text, n in zip(data.texts, data.tokens):
        t0 = time.thread_time()
        p = scorer.probabilities(text, n)
        scorer.choose(p)
        ms.append((time.thread_time() - t0) * 1000)
        P.append(p)
    return np.array(P), np.array(ms)


def _timed_v1(v1: Scorer, data: EngineLabels) -> np.ndarray:
    """The two-engine router's decision CPU time per prompt (score + threshold), in ms."""
    ms = []
    for text, n in zip(data.texts, data.tokens):
        t0 = time.thread_time()
        v1.goes_large(v1.score(text, n))
        ms.append((time.thread_time() - t0) * 1000)
    return np.array(ms)


def _pair(data: EngineLabels) -> EngineLabels:
    keep = [data.names.index("demo-small"), data.names.index("demo-large")]
    return EngineLabels([data.names[k] for k in keep], data.texts, data.tokens, data.correct[:, keep], data.meta)


def _bootstrap(P: np.ndarray, correct: np.ndarray, cost: np.ndarray, resamples: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {"apgr": [], "cpt_80": [], "cpt_95": []}
    for _ in range(resamples):
        idx = rng.integers(0, len(P), size=len(P))
        c = cost_cap_curve(P[idx], correct[idx], cost, max_points=300)
        draws["apgr"].append(apgr(c))
        for t in (80, 95):
            v = cpt(c, t / 100)
            draws[f"cpt_{t}"].append(1.0 if np.isnan(v) else v)
    return {"resamples": resamples, "seed": seed,
            **{k: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] for k, v in draws.items()}}


def _rel(path: str | Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def plot(report: dict, path: Path, third: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    cv = report["three"]["curves"]
    r3, r2 = report["three"]["cost_cap"], report["two_engine_router"]
    ax.plot(np.array(cv["oracle"]["cost"]) * 100, cv["oracle"]["quality"], color="tab:green", lw=1,
            label=f"oracle, three engines (APGR {report['three']['oracle']['apgr']:.2f})")
    ax.plot(np.array(cv["cost_cap"]["cost"]) * 100, cv["cost_cap"]["quality"], color="tab:blue",
            label=f"three engines, best under a cost cap (APGR {r3['apgr']:.3f}, CPT95 {r3['cpt_95'] * 100:.0f}%)")
    ax.plot(np.array(cv["quality_target"]["cost"]) * 100, cv["quality_target"]["quality"], ".", ms=3,
            color="tab:cyan", label="three engines, quality target 0..1 (each point one target)")
    ax.plot(np.array(report["two_engine_curve"]["cost"]) * 100, report["two_engine_curve"]["quality"],
            color="tab:purple", lw=1,
            label=f"two engines, shipped router (APGR {r2['apgr']:.3f}, CPT95 {r2['cpt_95'] * 100:.0f}%)")
    ax.plot(np.array(cv["random"]["cost"]) * 100, cv["random"]["quality"], "--", color="grey",
            label=f"random among the three (APGR {report['three']['random']['apgr']:.2f})")
    acc, nc = report["three"]["accuracy"], report["three"]["normalised_cost"]
    ax.plot([0, 100], [acc["demo-small"], acc["demo-large"]], ":", color="grey", lw=0.8,
            label="random small/large (APGR 0.50)")
    for name, colour in (("demo-small", "tab:orange"), (third, "tab:olive"), ("demo-large", "tab:red")):
        ax.scatter([nc[name] * 100], [acc[name]], color=colour, zorder=5, label=f"{name} only")
    d = report["three"]["at_quality_target"]
    ax.scatter([d["normalised_cost"] * 100], [d["accuracy"]], marker="x", s=80, color="black", zorder=6,
               label=f"calibrated quality target {d['target']:.2f}")
    ax.set_xlabel("mean cost per call (0 = every call to demo-small, 100 = every call to demo-large), %")
    ax.set_ylabel("accuracy on the test split")
    ax.set_title(f"Router with three engines (demo-small, {third}, demo-large) on {report['three']['prompts']} "
                 "held-out prompts", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--third", default="demo-medium", help="the third engine's name (its outcomes: "
                    "tokenyard/router_models/data/engines/NAME.jsonl unless --engine-file)")
    ap.add_argument("--third-cost", type=float, default=2.0, help="its relative cost per call (small 1, large 5)")
    ap.add_argument("--engine-file", default=None)
    ap.add_argument("--results-name", default="router_three_engines",
                    help="bench/results/NAME.json, bench/NAME.png, tokenyard/router_models/artifacts/NAME.json")
    ap.add_argument("--resamples", type=int, default=200)
    ap.add_argument("--train-items", type=int, default=None,
                    help="fit on the first N train prompts only (when the third engine labelled only those)")
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    engine_file = args.engine_file or str(DATA / "engines" / f"{args.third}.jsonl")
    plot_path = Path(args.plot or ROOT / "bench" / f"{args.results_name}.png")
    artifact = ARTIFACTS / f"{args.results_name.replace('router_three_engines', 'demo_router_3')}.json"
    costs = {**PAIR_COSTS, args.third: args.third_cost}
    import torch
    torch.set_num_threads(1)
    rec = RunRecorder(args.results_name)
    data = engine_labels(DATA, {args.third: engine_file}, train_items=args.train_items)
    train, cal, test = data["train"], data["calibration"], order_by_cost(data["test"], costs)
    t0 = time.perf_counter()
    es, _ = train_engine_set(train, cal, costs, training={"source": "suite", "folder": "tokenyard/router_models/data",
                                                          "extra": {args.third: _rel(engine_file)}})
    train_s = time.perf_counter() - t0
    save(es, artifact)
    scorer = EngineScorer(es)
    P, ms = _numpy_scores(scorer, test)
    cost = scorer.costs
    report3, _ = evaluate_engines(P, test.correct, cost, es.names, es.quality_target)
    report3["ci95"] = _bootstrap(P, test.correct, cost, args.resamples) if args.resamples else None
    # The pair alone, same method: what the third engine adds.
    es2, _ = train_engine_set(_pair(train), _pair(cal), PAIR_COSTS)
    P2 = np.array([EngineScorer(es2).probabilities(t, n) for t, n in zip(test.texts, test.tokens)])
    report2, _ = evaluate_engines(P2, _pair(test).correct, np.array([1.0, 5.0]), es2.names, es2.quality_target)
    # The shipped two-engine router on the same prompts: its share of large calls is the cost axis.
    v1 = Scorer(load_v1(ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"))
    s1 = np.array([v1.score(t, n) for t, n in zip(test.texts, test.tokens)])
    # Decision cost: a second pass of each router, interleaved, so neither pays the first pass's
    # cold caches (the figures are the second passes).
    ms, ms1 = _numpy_scores(scorer, test)[1], _timed_v1(v1, test)
    small, large = test.correct[:, 0], test.correct[:, -1]
    curve1 = routing_curve(s1, small, large)
    report = {"three": report3, "pair_p_good": {k: report2[k] for k in ("cost_cap", "random", "oracle",
                                                                          "at_quality_target", "accuracy")},
              "two_engine_router": summary(curve1),
              "two_engine_curve": {"cost": curve1.share.round(5).tolist(), "quality": curve1.quality.round(5).tolist()}}
    plot(report, plot_path, args.third)
    figures = {
        "test_prompts": len(test), "train_prompts": len(train), "calibration_prompts": len(cal),
        "accuracy": report3["accuracy"], "costs": costs,
        "three_apgr": report3["cost_cap"]["apgr"], "three_cpt_95": report3["cost_cap"]["cpt_95"],
        "three_cpt_80": report3["cost_cap"]["cpt_80"], "three_ci95": report3["ci95"],
        "three_at_quality_target": report3["at_quality_target"], "random_three_apgr": report3["random"]["apgr"],
        "oracle_three_apgr": report3["oracle"]["apgr"], "oracle_three_cpt_95": report3["oracle"]["cpt_95"],
        "pair_p_good_apgr": report2["cost_cap"]["apgr"], "pair_p_good_cpt_95": report2["cost_cap"]["cpt_95"],
        "two_engine_router_apgr": report["two_engine_router"]["apgr"],
        "two_engine_router_cpt_95": report["two_engine_router"]["cpt_95"],
        "decision_cpu_ms_p50": float(np.percentile(ms, 50)), "decision_cpu_ms_p99": float(np.percentile(ms, 99)),
        "two_engine_decision_cpu_ms_p50": float(np.percentile(ms1, 50)),
        "two_engine_decision_cpu_ms_p99": float(np.percentile(ms1, 99)),
        "train_s": train_s, "calibration": es.calibration, "quality_target": es.quality_target,
    }
    rec.write(figures, runs=[{k: v for k, v in report.items() if k != "two_engine_curve"}],
              artifact=_rel(artifact), plot=_rel(plot_path))
    r3 = report3["cost_cap"]
    print(f"three engines: APGR {r3['apgr']:.3f} {report3['ci95']['apgr'] if report3['ci95'] else ''}, "
          f"CPT(95%) {r3['cpt_95']:.3f}; random {report3['random']['apgr']:.3f}; oracle {report3['oracle']['apgr']:.3f}")
    print(f"pair with P(good) models: APGR {report2['cost_cap']['apgr']:.3f}, CPT(95%) {report2['cost_cap']['cpt_95']:.3f}; "
          f"shipped two-engine router: APGR {report['two_engine_router']['apgr']:.3f}, "
          f"CPT(95%) {report['two_engine_router']['cpt_95']:.3f}")
    print(f"at the calibrated quality target {es.quality_target}: {report3['at_quality_target']}")
    print(f"decision CPU p50 {figures['decision_cpu_ms_p50']:.3f} ms, p99 {figures['decision_cpu_ms_p99']:.3f} ms; "
          f"two-engine router {figures['two_engine_decision_cpu_ms_p50']:.3f} / "
          f"{figures['two_engine_decision_cpu_ms_p99']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
