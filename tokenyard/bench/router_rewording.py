"""Rewording benchmark: does the shipped router decide the same when the same prompt is worded anew?

    .venv/bin/python -m tokenyard.bench.router_rewording [--artifact tokenyard/router_models/artifacts/demo_router.json]
        [--labels tokenyard/router_models/data] [--limit N] [--seed 0] [--resamples 1000]
        [--no-results | --results-name router_rewording]

Inputs and outcomes: the router's test split (tokenyard/router_models/data/test.jsonl), its items in
the familiar phrasings 0-2, with the committed correctness of the small and the large demo engine on
them (the engines are not run again). Each item is read in its familiar wording and in every family
of tokenyard.bench.rewording_grammar (wording no template, training or calibration prompt uses),
and scored with the shipped artifact as the gateway scores a chat request: the messages' contents
joined by newlines, the chat-templated prompt length in the demo-small tokenizer, small when the
score is at or above the artifact's threshold.

Every wording is scored against the same outcomes, so a difference is the router's alone: paired
APGR and CPT(95%) (new minus familiar) and decision agreement (the same engine chosen at the
calibrated threshold), with paired percentile-bootstrap 95% intervals (items resampled, one
seeded numpy generator; a CPT a resample never reaches counts as 1.0, as in routing_metrics).
Raw output: bench/results/router_rewording.json.
"""
from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path

import numpy as np

from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.rewording_grammar import FAMILIES, reword
from tokenyard.demo import task_suite
from tokenyard.demo.router_labels import count_prompt_tokens
from tokenyard.router_models.runtime.artifact import load
from tokenyard.router_models.runtime.features import prompt_text
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.routing_metrics import apgr, cpt, routing_curve

ROOT = Path(__file__).resolve().parent.parent.parent
ARTIFACT = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"
LABELS = ROOT / "tokenyard" / "router_models" / "data"
FAMILIAR = "familiar"
CPT_TARGET = 0.95


def load_items(labels: Path, limit: int | None = None) -> list[dict]:
    """The test split's rows in familiar wording (phrasings 0-2), in file order."""
    rows = [json.loads(line) for line in (labels / "test.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["phrasing"] in task_suite.TRAIN_PHRASINGS]
    return rows[:limit] if limit is not None else rows


def _item_rng(seed: int, row_id: str, family: str) -> random.Random:
    # crc32, not hash(): the same wording on every run and machine for a seed
    return random.Random(zlib.crc32(f"{seed}|{row_id}|{family}".encode()))


def reworded_messages(row: dict, family: str, seed: int) -> list[dict[str, str]]:
    """The row's messages with its user message in `family`'s wording (system message kept)."""
    task = task_suite.get_task(row["task"])
    user = row["messages"][-1]["content"]
    fields = task.parse(user, row["phrasing"])
    text = reword(row["task"], fields, family, _item_rng(seed, row["id"], family), familiar=user)
    return [dict(m) for m in row["messages"][:-1]] + [{"role": "user", "content": text}]


def _known_user_texts(labels: Path) -> set[str]:
    """Every user message of the router's training and calibration data."""
    out = set()
    for name in ("train.jsonl", "calibration.jsonl"):
        for line in (labels / name).read_text().splitlines():
            if line.strip():
                out.add(json.loads(line)["messages"][-1]["content"])
    return out


def template_match(row_task: str, text: str) -> int | None:
    """The suite phrasing (0-5) whose template renders `text`, or None when none does."""
    task = task_suite.get_task(row_task)
    for phrasing in (*task_suite.ALL_PHRASINGS, *task_suite.ROUTER_TEST_PHRASINGS):
        try:
            task.parse(text, phrasing)
            return phrasing
        except ValueError:
            continue
    return None


def _stats(scores: np.ndarray, small: np.ndarray, large: np.ndarray) -> tuple[float, float]:
    curve = routing_curve(scores, small, large)
    c = cpt(curve, CPT_TARGET)
    return apgr(curve), 1.0 if np.isnan(c) else c


def paired_bootstrap(scores: dict[str, np.ndarray], small: np.ndarray, large: np.ndarray, threshold: float,
                     resamples: int, seed: int, level: float = 0.95) -> dict[str, dict]:
    """Per wording: intervals of APGR, CPT(95%) and large share, and of the paired differences
    from the familiar wording (APGR, CPT) and the agreement with its decisions, all on the same
    resamples of the items."""
    rng = np.random.default_rng(seed)
    n = small.size
    large_dec = {w: s < threshold for w, s in scores.items()}
    draws: dict[str, dict[str, list[float]]] = {w: {k: [] for k in ("apgr", "cpt_95", "large_share", "apgr_minus_familiar",
                                                                     "cpt_95_minus_familiar", "agreement")}
                                                for w in scores}
    for _ in range(resamples):
        idx = rng.integers(0, n, size=n)
        base = _stats(scores[FAMILIAR][idx], small[idx], large[idx])
        for w, s in scores.items():
            a, c = _stats(s[idx], small[idx], large[idx]) if w != FAMILIAR else base
            d = draws[w]
            d["apgr"].append(a)
            d["cpt_95"].append(c)
            d["large_share"].append(float(large_dec[w][idx].mean()))
            d["apgr_minus_familiar"].append(a - base[0])
            d["cpt_95_minus_familiar"].append(c - base[1])
            d["agreement"].append(float((large_dec[w][idx] == large_dec[FAMILIAR][idx]).mean()))
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return {w: {k: [float(np.percentile(v, lo)), float(np.percentile(v, hi))] for k, v in d.items()}
            for w, d in draws.items()}


def run(labels: Path = LABELS, artifact: Path = ARTIFACT, limit: int | None = None, seed: int = 0,
        resamples: int = 1000, families: tuple[str, ...] = FAMILIES) -> dict:
    """The report (figures): per wording its point figures and intervals, per task its large share."""
    rows = load_items(labels, limit)
    if not rows:
        raise ValueError(f"no familiar-wording test items in {labels}")
    art = load(str(artifact))
    scorer = Scorer(art)
    small = np.array([r["small_correct"] for r in rows], dtype=float)
    large = np.array([r["large_correct"] for r in rows], dtype=float)
    wordings: dict[str, list[list[dict[str, str]]]] = {FAMILIAR: [r["messages"] for r in rows]}
    for family in families:
        wordings[family] = [reworded_messages(r, family, seed) for r in rows]
    # Token counts as the gateway counts them (chat template, demo-small tokenizer), in one pass.
    flat = [task_suite.TaskItem(r["task"], r["level"], -1, tuple(m), r["answer"], "test")
            for msgs in wordings.values() for r, m in zip(rows, msgs)]
    counts = count_prompt_tokens(flat)
    n = len(rows)
    tokens = {w: counts[i * n:(i + 1) * n] for i, w in enumerate(wordings)}
    # The familiar wording's counts must be the committed ones the router was evaluated with.
    token_mismatches = sum(int(a != r["prompt_tokens"]) for a, r in zip(tokens[FAMILIAR], rows))
    scores = {w: np.array([scorer.score(prompt_text(m), t) for m, t in zip(msgs, tokens[w])])
              for w, msgs in wordings.items()}
    known = _known_user_texts(labels)
    tasks = np.array([r["task"] for r in rows])
    out: dict[str, dict] = {}
    fam_large = scores[FAMILIAR] < scorer.threshold
    intervals = paired_bootstrap(scores, small, large, scorer.threshold, resamples, seed) if resamples else {}
    for w, msgs in wordings.items():
        user = [m[-1]["content"] for m in msgs]
        a, c = _stats(scores[w], small, large)
        dec = scores[w] < scorer.threshold
        out[w] = {"apgr": a, "cpt_95": c, "large_share": float(dec.mean()),
                  "apgr_minus_familiar": a - out[FAMILIAR]["apgr"] if w != FAMILIAR else 0.0,
                  "cpt_95_minus_familiar": c - out[FAMILIAR]["cpt_95"] if w != FAMILIAR else 0.0,
                  "agreement": float((dec == fam_large).mean()),
                  "mean_prompt_tokens": float(np.mean(tokens[w])),
                  "large_share_by_task": {t: float(dec[tasks == t].mean()) for t in sorted(set(tasks.tolist()))},
                  "confusion_by_task": confusion_by_task(tasks, fam_large, dec, (large > 0) & (small == 0)),
                  "template_wordings": sum(template_match(r["task"], u) is not None for r, u in zip(rows, user)),
                  "in_train_or_calibration": sum(u in known for u in user),
                  "distinct_wordings": len(set(user)),
                  "example": user[0], "ci95": intervals.get(w)}
    return {"items": n, "quality_small": float(small.mean()), "quality_large": float(large.mean()),
            "threshold": scorer.threshold, "seed": seed, "resamples": resamples,
            "familiar_token_mismatches": token_mismatches, "wordings": out}


def confusion_by_task(tasks: np.ndarray, familiar_large: np.ndarray, new_large: np.ndarray,
                      needs_large: np.ndarray) -> dict[str, dict[str, float | int]]:
    """Per task: how often the new wording's decision equals the familiar one's, and the flips each
    way (to_large: small on the familiar wording, large on the new one), with how many of the flips
    to small hit prompts only the large engine answers (the flips that cost quality)."""
    out: dict[str, dict[str, float | int]] = {}
    for t in sorted(set(tasks.tolist())):
        m = tasks == t
        f, d = familiar_large[m], new_large[m]
        out[t] = {"items": int(m.sum()), "agreement": float((f == d).mean()),
                  "to_large": int((~f & d).sum()), "to_small": int((f & ~d).sum()),
                  "to_small_needing_large": int((f & ~d & needs_large[m]).sum())}
    return out


def _fmt(v: float, ci: list[float] | None, pct: bool = False, sign: bool = False) -> str:
    f = (lambda x: f"{x * 100:+.1f}%" if sign else f"{x * 100:.1f}%") if pct else \
        (lambda x: f"{x:+.3f}" if sign else f"{x:.3f}")
    return f"{f(v)} [{f(ci[0])}, {f(ci[1])}]" if ci else f(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", default=str(ARTIFACT))
    ap.add_argument("--labels", default=str(LABELS), help="folder with train, calibration and test.jsonl")
    ap.add_argument("--limit", type=int, help="only the first N familiar-wording test items")
    ap.add_argument("--seed", type=int, default=0, help="wordings and bootstrap resamples")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--results-name", default="router_rewording", help="bench/results/<name>.json")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    rec = RunRecorder(args.results_name)
    report = run(Path(args.labels), Path(args.artifact), args.limit, args.seed, args.resamples)
    print(f"{report['items']} items: small {report['quality_small']:.3f}, large {report['quality_large']:.3f}, "
          f"threshold {report['threshold']:.4f}, familiar token-count mismatches {report['familiar_token_mismatches']}")
    for w, s in report["wordings"].items():
        ci = s["ci95"] or {}
        print(f"{w:10s} APGR {_fmt(s['apgr'], ci.get('apgr'))}  CPT(95%) {_fmt(s['cpt_95'], ci.get('cpt_95'), True)}  "
              f"large {_fmt(s['large_share'], ci.get('large_share'), True)}")
        if w != FAMILIAR:
            print(f"{'':10s} vs familiar: APGR {_fmt(s['apgr_minus_familiar'], ci.get('apgr_minus_familiar'), sign=True)}"
                  f"  CPT(95%) {_fmt(s['cpt_95_minus_familiar'], ci.get('cpt_95_minus_familiar'), True, True)}"
                  f"  agreement {_fmt(s['agreement'], ci.get('agreement'), True)}"
                  f"  (template wordings {s['template_wordings']}, seen in train/cal {s['in_train_or_calibration']})")
            print(f"{'':10s} e.g. {s['example']!r}")
    worst = sorted(((w, t, c) for w, s in report["wordings"].items() if w != FAMILIAR
                    for t, c in s["confusion_by_task"].items()), key=lambda x: x[2]["agreement"])[:8]
    print("least agreement (wording, task: agreement, flips to large / to small, of those needing large): " + "; ".join(
        f"{w} {t} {c['agreement'] * 100:.0f}% {c['to_large']}/{c['to_small']} ({c['to_small_needing_large']})"
        for w, t, c in worst))
    print("large share by task: " + "; ".join(
        f"{t} " + "/".join(f"{report['wordings'][w]['large_share_by_task'][t] * 100:.0f}" for w in report["wordings"])
        for t in report["wordings"][FAMILIAR]["large_share_by_task"]) + f"  ({' / '.join(report['wordings'])}, %)")
    if not args.no_results:
        runs = [{"wording": w, **{k: v for k, v in s.items() if k not in ("ci95", "example")}}
                for w, s in report["wordings"].items()]
        rec.write(report, runs, artifact=str(Path(args.artifact).resolve().relative_to(ROOT))
                  if Path(args.artifact).resolve().is_relative_to(ROOT) else args.artifact)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
