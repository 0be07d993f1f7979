"""How many feedback items does the router need to learn a tenant whose preferences differ from the
demo labels? (issue 51, item 3)

A simulated tenant prefers the large engine for one task family that the shipped router sends to the
small one (e.g. `lookup`: 0% large calls). Its feedback items are the family's prompts from the router
test split (familiar phrasings 0-2), each labelled "large needed" (what POST /v1/feedback with
`preferred_engine: <large>` or a low score on a small answer stores). For N feedback items and traffic
weight W, the router is retrained as `tokenyard router train --from-traffic` does
(tokenyard/router_models/training/traffic_labels.py: demo train split + the N rows x W, threshold
calibrated on the demo calibration split) and measured on the family's other half (prompts no
feedback named): the share sent large. Other families' large shares are reported beside it (what the
new labels cost the rest of the traffic), and the demo test split's APGR.

    python -m tokenyard.bench.router_feedback_learning                 # lookup, reverse; W 1, 4, 8, 16
    python -m tokenyard.bench.router_feedback_learning --family add --weights 8 --counts 5 10 20

Writes bench/results/router_feedback_learning.json (RunRecorder).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"
ARTIFACT = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"
FLIP = 0.5          # the family counts as learned once at least half its unseen prompts go large


def family_rows(family: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """(feedback pool, held-out half) of the family's familiar-wording test prompts, and every family's rows."""
    from tokenyard.router_models.training.train import read_jsonl
    by: dict[str, list[dict[str, Any]]] = {}
    for r in read_jsonl(DATA / "test.jsonl"):
        if r["phrasing"] in (0, 1, 2):
            by.setdefault(r["task"], []).append(r)
    rows = by[family]
    return rows[::2], rows[1::2], by


def large_share(scorer: Any, rows: list[dict[str, Any]]) -> float:
    return float(np.mean([scorer.goes_large(scorer.score(r["prompt"], r["prompt_tokens"])) for r in rows]))


def run_one(family: str, weight: int, n: int, train: Any, cal: Any, test: Any) -> dict[str, Any]:
    from tokenyard.router_models.runtime.scorer import Scorer
    from tokenyard.router_models.training.evaluation import evaluate
    from tokenyard.router_models.training.traffic_labels import traffic_training_set
    from tokenyard.router_models.training.train import train_router

    pool, held, by = family_rows(family)
    rows = [{"prompt": r["prompt"], "prompt_tokens": r["prompt_tokens"], "label": 0} for r in pool[:n]]
    tr, ca, _ = traffic_training_set(rows, train, cal, weight)
    art, _ = train_router(tr, ca)
    s = Scorer(art)
    report, _ = evaluate(art, test, resamples=0)
    return {"family": family, "weight": weight, "feedback_items": len(rows), "held_out_prompts": len(held),
            "held_out_large_share": large_share(s, held),
            "other_families_large_share": {t: round(large_share(s, r), 4) for t, r in sorted(by.items()) if t != family},
            "test_apgr": report["router"]["apgr"], "threshold": art.threshold}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenyard.bench.router_feedback_learning")
    ap.add_argument("--family", action="append", default=None, help="task family (repeatable; default lookup, reverse)")
    ap.add_argument("--weights", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--counts", type=int, nargs="+", default=[5, 10, 20, 30, 40, 64])
    ap.add_argument("--name", default="router_feedback_learning")
    args = ap.parse_args(argv)
    from tokenyard.bench.results_io import RunRecorder
    from tokenyard.router_models.runtime.artifact import load
    from tokenyard.router_models.runtime.scorer import Scorer
    from tokenyard.router_models.training.train import load_labels

    rec = RunRecorder(args.name)
    train, cal, test = (load_labels(DATA / f) for f in ("train.jsonl", "calibration.jsonl", "test.jsonl"))
    shipped = Scorer(load(ARTIFACT))
    families = args.family or ["lookup", "reverse"]
    runs, figures = [], {}
    for family in families:
        pool, held, by = family_rows(family)
        figures[f"{family}_shipped_large_share"] = large_share(shipped, held)
        for weight in args.weights:
            flipped_at = None
            for n in args.counts:
                if n > len(pool):
                    continue
                run = run_one(family, weight, n, train, cal, test)
                runs.append(run)
                print(json.dumps(run), flush=True)
                if flipped_at is None and run["held_out_large_share"] >= FLIP:
                    flipped_at = n
            figures[f"{family}_w{weight}_items_to_flip"] = flipped_at
    rec.write(figures=figures, runs=runs, options={"families": families, "weights": args.weights,
                                                   "counts": args.counts, "flip_share": FLIP})
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
