"""Issue 51 item 2, third round: the input's difficulty as a router feature, and how far any router can go.

    .venv/bin/python -m tokenyard.bench.router_difficulty [--seeds 0,1,2] [--resamples 1000]
        [--artifact tokenyard/router_models/artifacts/demo_router.json] [--no-results | --results-name router_difficulty]

Three parts, all on the rewording benchmark's items (the test split's familiar phrasings 0-2, with
their committed outcomes; tokenyard.bench.router_rewording):

  compare  the shipped artifact (feature version 4: payload_difficulty's signatures in the cross
           block) against the version-3 recipe retrained here (the same data, augmentation, C and
           calibration; `spec.difficulty` off, so it equals the artifact shipped before), paired on
           every wording of every grammar seed in --seeds: per wording, both routers' APGR, CPT(95%),
           drop from familiar and agreement with their own familiar decisions, and the paired
           difference new - base of APGR and CPT with percentile-bootstrap 95% intervals (items
           resampled, the same resamples for both routers).
  extract  how often payload_difficulty reads the right count on the count prompts of each wording
           (and how often it reads one where there is none), against the suite's answer.
  bound    what reading the task and the input perfectly could reach, on the familiar wording (a
           wording-free router scores every wording of an item alike, so this is also its figure on
           every new wording): logistic regressions fitted on the train and calibration splits'
           phrasing 0-2 rows with the TRUE task (the suite's label, combo split by kind), level,
           system prompt and payload features parsed by the suite's own templates (word count, word
           identities, the counted letter's answer, digits and carries, the numbers' count; once
           more without the count task's features, to see what the count alone is worth),
           scoring P(small right) - P(large right); plus in-sample cell means (task x level
           [x system prompt]) on the test items themselves, an optimistic ceiling for a router
           that knows those cells. With bootstrap intervals of APGR and CPT(95%).

Nothing here reads the benchmark's grammar except through router_rewording's own scoring; no
choice in the shipped recipe was made on these figures (payload_difficulty's rule was written and
checked on the suite's templates; its miss rate on the benchmark's wordings is reported, not fixed).
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import numpy as np

from tokenyard.bench import router_feature_trials as trials
from tokenyard.bench import router_rewording as rr
from tokenyard.bench.results_io import RunRecorder
from tokenyard.demo import task_suite
from tokenyard.router_models.runtime.artifact import load
from tokenyard.router_models.runtime.features import FeatureSpec, window_of
from tokenyard.router_models.runtime.payload_difficulty import letter_count
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training import train as T
from tokenyard.router_models.training.routing_metrics import apgr, cpt, routing_curve

CPT_TARGET = 0.95


def _stats(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> tuple[float, float]:
    curve = routing_curve(scores, small, large)
    c = cpt(curve, CPT_TARGET)
    return apgr(curve), 1.0 if np.isnan(c) else c


def _ci(values: list[float]) -> list[float]:
    return [float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))]


def bootstrap(scores: np.ndarray, small: np.ndarray, large: np.ndarray, resamples: int, seed: int,
              baseline: np.ndarray | None = None) -> dict:
    """Intervals of APGR and CPT(95%); with `baseline`, of the paired differences too."""
    rng = np.random.default_rng(seed)
    n = small.size
    d: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(resamples):
        idx = rng.integers(0, n, size=n)
        a, c = _stats(scores[idx], small[idx], large[idx])
        d["apgr"].append(a)
        d["cpt_95"].append(c)
        if baseline is not None:
            ab, cb = _stats(baseline[idx], small[idx], large[idx])
            d["apgr_minus_base"].append(a - ab)
            d["cpt_95_minus_base"].append(c - cb)
    return {k: _ci(v) for k, v in d.items()}


def base_artifact(train: T.Labelled, cal: T.Labelled):
    """The version-3 recipe (the artifact shipped before version 4), retrained."""
    spec = FeatureSpec(cross_weight=T.DEFAULT_CROSS_WEIGHT, normalise=True, window=T.NORMALISED_WINDOW,
                       difficulty=False, version=3)
    art, _ = T.train_router(train, cal, spec=spec)
    return art


def compare(artifact: Path, seeds: tuple[int, ...], resamples: int) -> dict:
    train, cal = T.load_labels(rr.LABELS / "train.jsonl"), T.load_labels(rr.LABELS / "calibration.jsonl")
    routers = {"base_v3": Scorer(base_artifact(train, cal)), "shipped_v4": Scorer(load(str(artifact)))}
    out: dict[str, dict] = {}
    for seed in seeds:
        bench = trials.Bench(seed)
        scores = {name: {w: np.array([s.score(t, n) for t, n in zip(bench.texts[w], bench.tokens[w])])
                         for w in bench.texts} for name, s in routers.items()}
        per: dict[str, dict] = {}
        for w in bench.texts:
            row: dict[str, dict] = {}
            for name, s in routers.items():
                a, c = _stats(scores[name][w], bench.small, bench.large)
                fa, _ = _stats(scores[name][rr.FAMILIAR], bench.small, bench.large)
                dec, fam = scores[name][w] < s.threshold, scores[name][rr.FAMILIAR] < s.threshold
                row[name] = {"apgr": a, "cpt_95": c, "apgr_minus_familiar": a - fa,
                             "agreement": float((dec == fam).mean()), "large_share": float(dec.mean())}
            if resamples:
                ci = bootstrap(scores["shipped_v4"][w], bench.small, bench.large, resamples, seed,
                               baseline=scores["base_v3"][w])
                row["shipped_v4"]["ci95"] = {k: ci[k] for k in ("apgr", "cpt_95")}
                row["difference"] = {"apgr": row["shipped_v4"]["apgr"] - row["base_v3"]["apgr"],
                                     "cpt_95": row["shipped_v4"]["cpt_95"] - row["base_v3"]["cpt_95"],
                                     "ci95": {"apgr": ci["apgr_minus_base"], "cpt_95": ci["cpt_95_minus_base"]}}
            per[w] = row
        out[f"seed_{seed}"] = per
        if seed == seeds[0]:
            out["extract"] = extraction(bench)
    out["thresholds"] = {name: s.threshold for name, s in routers.items()}
    return out


def extraction(bench: trials.Bench) -> dict[str, dict]:
    """payload_difficulty's count against the suite's answer, per wording."""
    out = {}
    for w, texts in bench.texts.items():
        right = wrong = missing = spurious = 0
        for r, text in zip(bench.rows, texts):
            got = letter_count(window_of(text, T.NORMALISED_WINDOW))
            if r["task"] == "count":
                if got is None:
                    missing += 1
                elif got[0] == int(r["answer"]):
                    right += 1
                else:
                    wrong += 1
            elif got is not None:
                spurious += 1
        out[w] = {"count_prompts": right + wrong + missing, "right": right, "wrong": wrong, "none": missing,
                  "signature_on_other_tasks": spurious}
    return out


# --- the bound: the true task and the input parsed perfectly --------------------------------------

def _system(row: dict) -> str:
    return row["messages"][0]["content"] if len(row["messages"]) > 1 else ""


def _carries(a: int, b: int) -> int:
    carries = carry = 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        carries += carry
        a, b = a // 10, b // 10
    return carries


def told_features(row: dict, parts: tuple[str, ...]) -> dict[str, float]:
    """A row's features from its true task and its input as the suite's template parses it."""
    fields = task_suite.get_task(row["task"]).parse(row["messages"][-1]["content"], row["phrasing"])
    key = fields.get("kind", row["task"])
    f: dict[str, float] = {"t=" + key: 1.0}
    if "level" in parts:
        f[f"level={key}{row['level']}"] = 1.0
    if "system" in parts:
        f[f"system={key}|{_system(row)}"] = 1.0
    if "payload" in parts:
        if "words" in fields:
            words = fields["words"].split()
            f[f"{key}:n={len(words)}"] = 1.0
            f[key + ":n"] = len(words)
            for w in words:
                f[f"{key}:w={w}"] = 1.0
        if "seq" in fields and "no_count" not in parts:
            seq = fields["seq"].split()
            c = seq.count(fields["letter"])
            f.update({"count:n": len(seq), "count:answer": c, f"count:answer={c}": 1.0,
                      f"count:n={len(seq)}|answer={c}": 1.0, f"count:letter={fields['letter']}": 1.0})
        if "nums" in fields:
            nums = fields["nums"].split()
            digits = max(map(len, nums))
            f.update({"sort:n": len(nums), "sort:digits": digits, f"sort:n={len(nums)}|digits={digits}": 1.0})
        if "a" in fields:
            digits, car = max(len(fields["a"]), len(fields["b"])), _carries(int(fields["a"]), int(fields["b"]))
            f.update({key + ":digits": digits, key + ":carries": car, f"{key}:digits={digits}|carries={car}": 1.0})
        if "name" in fields:
            f["name=" + fields["name"]] = 1.0
    return f


def repeated_inputs() -> dict[str, dict[str, int]]:
    """Per split (familiar phrasings): inputs asked more than once (another phrasing or system
    prompt) and how many of those got different outcomes: what wording alone decides, which a
    wording-free router cannot know."""
    out = {}
    for name in ("train.jsonl", "calibration.jsonl", "test.jsonl"):
        seen: dict[tuple, set] = collections.defaultdict(set)
        rows: collections.Counter = collections.Counter()
        for r in T.read_jsonl(rr.LABELS / name):
            if r["phrasing"] not in task_suite.TRAIN_PHRASINGS:
                continue
            fields = task_suite.get_task(r["task"]).parse(r["messages"][-1]["content"], r["phrasing"])
            key = (r["task"], tuple(sorted(fields.items())))
            seen[key].add((r["small_correct"], r["large_correct"]))
            rows[key] += 1
        repeated = [k for k, n in rows.items() if n > 1]
        out[name] = {"inputs": len(rows), "repeated": len(repeated),
                     "repeated_with_other_outcomes": sum(len(seen[k]) > 1 for k in repeated)}
    return out


def bound(resamples: int) -> dict:
    from sklearn.feature_extraction import DictVectorizer
    from sklearn.linear_model import LogisticRegression

    fit_rows = [r for name in ("train.jsonl", "calibration.jsonl") for r in T.read_jsonl(rr.LABELS / name)
                if r["phrasing"] in task_suite.TRAIN_PHRASINGS]
    test = rr.load_items(rr.LABELS)
    small = np.array([r["small_correct"] for r in test], dtype=float)
    large = np.array([r["large_correct"] for r in test], dtype=float)
    out: dict[str, dict] = {"fit_rows": len(fit_rows), "test_items": len(test)}
    for name, parts in (("task_level", ("level",)), ("task_level_system", ("level", "system")),
                        ("task_level_system_payload", ("level", "system", "payload")),
                        ("task_level_system_payload_without_count", ("level", "system", "payload", "no_count")),
                        ("task_system_payload", ("system", "payload"))):
        vec = DictVectorizer()
        X = vec.fit_transform([told_features(r, parts) for r in fit_rows])
        Xt = vec.transform([told_features(r, parts) for r in test])
        p = {}
        for outcome in ("small_correct", "large_correct"):
            y = np.array([r[outcome] for r in fit_rows], dtype=int)
            p[outcome] = LogisticRegression(C=1.0, max_iter=5000).fit(X, y).predict_proba(Xt)[:, 1]
        scores = p["small_correct"] - p["large_correct"]
        a, c = _stats(scores, small, large)
        out[f"learned_{name}"] = {"apgr": a, "cpt_95": c, **({"ci95": bootstrap(scores, small, large, resamples, 0)}
                                                           if resamples else {})}
    for name, key in (("task_level", lambda r: (r["task"], r["level"])),
                      ("task_level_system", lambda r: (r["task"], r["level"], _system(r)))):
        cells: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, r in enumerate(test):
            cells[key(r)].append(i)
        scores = np.zeros(len(test))
        for idx in cells.values():
            scores[idx] = (small[idx] - large[idx]).mean()
        a, c = _stats(scores, small, large)
        out[f"in_sample_cells_{name}"] = {"apgr": a, "cpt_95": c, "cells": len(cells)}
    out["repeated_inputs"] = repeated_inputs()
    oracle = np.where((small == 0) & (large == 1), 0.0, np.where((small == 1) & (large == 0), 1.0, 0.5))
    a, c = _stats(oracle, small, large)
    out["oracle_labels"] = {"apgr": a, "cpt_95": c}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(rr.ARTIFACT))
    ap.add_argument("--seeds", default="0,1,2", help="grammar seeds (comma-separated)")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--parts", default="compare,bound", help="comma-separated: compare, bound")
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--results-name", default="router_difficulty")
    args = ap.parse_args(argv)
    seeds = tuple(int(s) for s in args.seeds.split(",") if s)
    parts = {p for p in args.parts.split(",") if p}
    if not seeds or parts - {"compare", "bound"}:
        ap.error("--seeds needs at least one seed; --parts takes compare and/or bound")
    rec = RunRecorder(args.results_name)
    report: dict[str, dict] = {}
    t0 = time.perf_counter()
    if "compare" in parts:
        report["compare"] = compare(Path(args.artifact), seeds, args.resamples)
        for seed in seeds:
            for w, row in report["compare"][f"seed_{seed}"].items():
                b, n = row["base_v3"], row["shipped_v4"]
                diff = row.get("difference")
                print(f"seed {seed} {w:10s} base APGR {b['apgr']:.3f} ({b['apgr_minus_familiar']:+.3f}, "
                      f"{b['agreement'] * 100:.1f}%, CPT {b['cpt_95'] * 100:.1f}%) -> v4 {n['apgr']:.3f} "
                      f"({n['apgr_minus_familiar']:+.3f}, {n['agreement'] * 100:.1f}%, CPT {n['cpt_95'] * 100:.1f}%)"
                      + (f"  diff APGR {diff['apgr']:+.3f} {[round(x, 3) for x in diff['ci95']['apgr']]} CPT "
                         f"{diff['cpt_95'] * 100:+.1f} {[round(x * 100, 1) for x in diff['ci95']['cpt_95']]}"
                         if diff else ""))
        print("extraction:", report["compare"]["extract"])
    if "bound" in parts:
        report["bound"] = bound(args.resamples)
        for k, v in report["bound"].items():
            print("bound", k, v)
    report["seconds"] = time.perf_counter() - t0
    if not args.no_results:
        rec.write(report, [], artifact=str(Path(args.artifact).resolve().relative_to(rr.ROOT))
                  if Path(args.artifact).resolve().is_relative_to(rr.ROOT) else args.artifact)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
