"""The router's hyper-parameters, chosen on the calibration split only (never the test split).

    .venv/bin/python -m tokenyard.bench.router_select [--labels tokenyard/router_models/data]

A grid of protocol (folds=0: fitted on train, calibration held out; folds=2: fitted on train +
the other calibration fold) x label design (small_enough, expected_gain) x C x cross weight, each
point scored by the APGR and CPT of calibration scores from models that never saw those prompts
(tokenyard.router_models.training.select). Prints the grid, each protocol's best point per label design with
a bootstrap interval, and the paired difference between the label designs.
Raw output: bench/results/router_select.json. The values `tokenyard router train` uses by default
(train.DEFAULT_*) are the best point of the shipped protocol and labels.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tokenyard.bench.results_io import RunRecorder
from tokenyard.router_models.training.select import GRID_C, GRID_CROSS_WEIGHT, select
from tokenyard.router_models.training.train import load_labels

ROOT = Path(__file__).resolve().parent.parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--labels", default=str(ROOT / "tokenyard" / "router_models" / "data"))
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    rec = RunRecorder("router_select")
    folder = Path(args.labels)
    out = select(load_labels(folder / "train.jsonl"), load_labels(folder / "calibration.jsonl"),
                 protocols=(0, 2), resamples=args.resamples)
    print("| folds | labels | C | cross weight | APGR | CPT(80%) | CPT(95%) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p in out["points"]:
        print(f"| {p['folds']} | {p['labels']} | {p['C']} | {p['cross_weight']} | {p['apgr']:.3f} | "
              f"{p['cpt_80'] * 100:.1f}% | {p['cpt_95'] * 100:.1f}% |")
    for folds, cell in out["protocols"].items():
        for design, b in cell["best"].items():
            ci = cell["bootstrap"][design]
            print(f"folds={folds} best {design}: C={b['C']} cross_weight={b['cross_weight']}: APGR {b['apgr']:.3f} "
                  f"[{ci['apgr'][0]:.3f}, {ci['apgr'][1]:.3f}], CPT(95%) {b['cpt_95'] * 100:.1f}% "
                  f"[{ci['cpt_95'][0] * 100:.1f}, {ci['cpt_95'][1] * 100:.1f}]")
        for name, d in cell.items():
            if name.endswith("_minus_small_enough"):
                print(f"folds={folds} {name}: APGR [{d['apgr'][0]:+.3f}, {d['apgr'][1]:+.3f}], "
                      f"CPT(95%) [{d['cpt_95'][0] * 100:+.1f}, {d['cpt_95'][1] * 100:+.1f}] points")
    if not args.no_results:
        rec.write({k: v for k, v in out.items() if k != "points"}, out["points"], grid={"C": list(GRID_C),
                  "cross_weight": list(GRID_CROSS_WEIGHT)}, labels=str(folder.resolve().relative_to(ROOT))
                  if folder.resolve().is_relative_to(ROOT) else str(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
