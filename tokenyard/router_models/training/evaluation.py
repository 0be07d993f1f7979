"""`tokenyard router eval`: the router against random routing, the oracle and each single model
on a labelled test split; a JSON report and a PNG plot of quality against share of large calls.
The router's APGR and CPT come with percentile-bootstrap 95% intervals (prompts resampled)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenyard.router_models.runtime.artifact import Artifact
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.routing_metrics import (
    Curve,
    at_threshold,
    bootstrap,
    oracle_scores,
    random_curve,
    routing_curve,
    summary,
)
from tokenyard.router_models.training.train import Labelled

TARGETS = (0.5, 0.8, 0.95)


def score_all(scorer: Scorer, data: Labelled) -> np.ndarray:
    return np.array([scorer.score(t, n) for t, n in zip(data.texts, data.tokens)])


def evaluate(artifact: Artifact, test: Labelled, random_seed: int = 0,
             resamples: int = 1000) -> tuple[dict[str, Any], dict[str, Curve]]:
    """The report (resamples=0: no bootstrap intervals) and the curves."""
    if test.small_correct is None or test.large_correct is None:
        raise ValueError("evaluation needs small_correct and large_correct for every test prompt")
    scorer = Scorer(artifact)
    scores = score_all(scorer, test)
    small, large = test.small_correct, test.large_correct
    router = routing_curve(scores, small, large)
    oracle = routing_curve(oracle_scores(small, large), small, large)
    rand = random_curve(router.quality_small, router.quality_large)
    # One actual random draw too, to show the expectation line is what random routing does.
    drawn = routing_curve(np.random.default_rng(random_seed).random(len(test)), small, large)
    curves = {"router": router, "oracle": oracle, "random": rand, "random_draw": drawn}
    report: dict[str, Any] = {
        "test_prompts": len(test),
        "quality_small": router.quality_small, "quality_large": router.quality_large,
        "label_1_share": float(test.labels.mean()),
        "router": summary(router, TARGETS), "random": summary(rand, TARGETS),
        "router_ci95": bootstrap(scores, small, large, resamples=resamples) if resamples else None,
        "random_draw": summary(drawn, TARGETS), "oracle": summary(oracle, TARGETS),
        "calibrated": {**at_threshold(scores, small, large, artifact.threshold),
                       "method": artifact.threshold_method, "target": artifact.threshold_target},
        "by_task": _by_task(test, scores, artifact.threshold),
        "curves": {name: {"share": c.share.round(5).tolist(), "quality": c.quality.round(5).tolist()}
                   for name, c in curves.items() if name != "random_draw"},
    }
    return report, curves


def _by_task(test: Labelled, scores: np.ndarray, threshold: float) -> dict[str, Any]:
    if not test.meta or "task" not in test.meta[0]:
        return {}
    out: dict[str, Any] = {}
    tasks = np.array([m["task"] for m in test.meta])
    for task in sorted(set(tasks.tolist())):
        m = tasks == task
        out[task] = {"prompts": int(m.sum()), "small": float(test.small_correct[m].mean()),
                     "large": float(test.large_correct[m].mean()),
                     "label_1_share": float(test.labels[m].mean()),
                     "mean_score": float(scores[m].mean()),
                     "large_share_at_threshold": float((scores[m] < threshold).mean())}
    return out


def plot(report: dict[str, Any], curves: dict[str, Curve], path: str | Path, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    r, o = report["router"], report["oracle"]
    ax.plot(curves["oracle"].share * 100, curves["oracle"].quality, color="tab:green",
            label=f"oracle (APGR {o['apgr']:.2f})")
    ax.plot(curves["router"].share * 100, curves["router"].quality, color="tab:blue",
            label=f"router (APGR {r['apgr']:.2f}, CPT95 {r['cpt_95'] * 100:.0f}%)")
    ax.plot(curves["random"].share * 100, curves["random"].quality, "--", color="grey", label="random (APGR 0.50)")
    ax.plot(curves["random_draw"].share * 100, curves["random_draw"].quality, color="grey", alpha=0.4, lw=0.8,
            label="one random draw")
    ax.scatter([0], [report["quality_small"]], color="tab:orange", zorder=5, label="small only")
    ax.scatter([100], [report["quality_large"]], color="tab:red", zorder=5, label="large only")
    cal = report["calibrated"]
    ax.scatter([cal["large_share"] * 100], [cal["quality"]], marker="x", s=80, color="black", zorder=6,
               label=f"calibrated threshold ({cal['large_share'] * 100:.0f}% large)")
    gap95 = report["quality_small"] + 0.95 * (report["quality_large"] - report["quality_small"])
    ax.axhline(gap95, color="tab:red", lw=0.6, ls=":", label="95% of the gap")
    ax.set_xlabel("share of calls to the large model (%)")
    ax.set_ylabel("accuracy on the test split")
    ax.set_title(title or f"Router on {report['test_prompts']} held-out prompts")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
