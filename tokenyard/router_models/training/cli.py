"""`tokenyard router train | eval`: train the learned router and measure it.

    tokenyard router train                                   # from the suite label files
    tokenyard router train --labels judged.jsonl --small a --large b   # operator judgements: prompt,
                                                             # engine, good/score per line (judgments.py)
    tokenyard router train --traffic labelled.jsonl          # operator traffic: {"prompt", "label"} per line
    tokenyard router train --target-large-share 0.25         # or --target-quality 0.95 (PGR on calibration)
    tokenyard router train --engine demo-medium=tokenyard/router_models/data/engines/demo-medium.jsonl \
        --cost demo-small=1 --cost demo-medium=2 --cost demo-large=5    # N engines: P(good) per engine
    tokenyard router eval                                    # test split -> tokenyard/bench/router_eval.{json,png}

Operator files without `prompt_tokens` are counted with --tokenizer's tokenizer (the serving
model's folder); that import happens here, never in the scoring path. Operator files have no
calibration split: a stable hash of each prompt holds out 25% of the prompts for it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tokenyard" / "router_models" / "data"
ARTIFACT = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"


def add_arguments(ap: argparse.ArgumentParser) -> argparse._SubParsersAction:
    """The train and eval commands; returns the subparsers (tokenyard/cli/router.py adds the traffic ones)."""
    sub = ap.add_subparsers(dest="router_command", required=True)
    tr = sub.add_parser("train", help="train the router and calibrate its threshold")
    src = tr.add_mutually_exclusive_group()
    src.add_argument("--labels", default=str(DATA),
                     help="a folder with train.jsonl and calibration.jsonl (tokenyard/demo/router_labels.py), or a JSONL "
                          "file of judged answers: prompt (or messages), engine, good (true/false) or score "
                          "(0..1), optional prompt_tokens; default: %(default)s")
    src.add_argument("--traffic", help="JSONL of operator-labelled prompts: prompt, label (1: small is enough), "
                                       "optional prompt_tokens; a stable hash holds out 25%% for calibration")
    tr.add_argument("--tokenizer", default=str(ROOT / "models" / "demo-small"),
                    help="checkpoint folder whose tokenizer counts prompts that lack prompt_tokens")
    tr.add_argument("--out", default=str(ARTIFACT))
    tr.add_argument("--small", default="demo-small", help="the small engine's name in a judgement file")
    tr.add_argument("--large", default="demo-large", help="the large engine's name in a judgement file")
    tr.add_argument("--C", type=float, default=None, help="inverse L2 strength (default: train.DEFAULT_C)")
    tr.add_argument("--objective", choices=["expected_gain", "small_enough"], default=None,
                    help="what the score estimates (default: train.DEFAULT_LABELS; --traffic files: small_enough)")
    tr.add_argument("--folds", type=int, default=None,
                    help="0: fit on the train part, calibrate on the calibration part; k >= 2: fit on both, "
                         "calibrate on k-fold out-of-fold scores (default: train.DEFAULT_FOLDS)")
    tr.add_argument("--engine", action="append", default=[], metavar="NAME=FILE",
                    help="a further engine's outcomes on the suite prompts ({\"id\", \"correct\"} per line, "
                         "tokenyard/bench/router_third_engine.py): trains an N-engine artifact (format version 2) with one "
                         "P(good) model per engine; repeatable")
    tr.add_argument("--cost", action="append", default=[], metavar="NAME=X",
                    help="relative cost of one call per engine (N-engine training; every engine needs one)")
    tr.add_argument("--cost-cap", type=float, default=None,
                    help="N-engine default selection: the best engines for this mean cost per call (else the "
                         "quality target reaching --target-quality, default 0.95, of the gap on calibration)")
    target = tr.add_mutually_exclusive_group()
    target.add_argument("--target-large-share", type=float, help="share of calls to send to the large model")
    target.add_argument("--target-quality", type=float,
                        help="fraction of the small-to-large quality gap to recover on calibration (e.g. 0.95)")
    tr.set_defaults(func=run_train)
    ev = sub.add_parser("eval", help="quality vs share of large calls on the test split; APGR, CPT")
    ev.add_argument("--artifact", default=str(ARTIFACT))
    ev.add_argument("--test", default=str(DATA / "test.jsonl"))
    ev.add_argument("--json", default=str(ROOT / "bench" / "router_eval.json"))
    ev.add_argument("--plot", default=str(ROOT / "bench" / "router_eval.png"))
    ev.set_defaults(func=run_eval)
    return sub


def _counter(tokenizer_dir: str):
    from tokenyard.engines.text.tokenizer import Tokenizer  # offline only: training may use the engine's tokenizer

    return Tokenizer.from_dir(tokenizer_dir).count_tokens


def _count_missing(rows: list[dict], tokenizer_dir: str) -> None:
    missing = [r for r in rows if "prompt_tokens" not in r]
    if not missing:
        return
    count = _counter(tokenizer_dir)
    for r in missing:
        r["prompt_tokens"] = count(str(r.get("prompt", "")))


def run_train(args: argparse.Namespace) -> int:
    from tokenyard.router_models.runtime.artifact import save
    from tokenyard.router_models.training.train import (
        DEFAULT_C,
        DEFAULT_LABELS,
        from_rows,
        hash_split,
        load_labels,
        read_jsonl,
        train_router,
    )

    C = DEFAULT_C if args.C is None else args.C
    if args.engine:
        return _train_engines(args, C)
    objective = args.objective or DEFAULT_LABELS
    try:
        if args.traffic:
            rows = read_jsonl(args.traffic)
            _count_missing(rows, args.tokenizer)
            train, cal = hash_split(from_rows(rows, args.traffic))
            source = {"source": "traffic", "file": args.traffic}
            objective = args.objective or "small_enough"     # a 0/1 label has no small-only outcome
        elif Path(args.labels).is_file():
            from tokenyard.router_models.training.judgments import read_judgements, summary_dict, to_labelled

            judged, summary = to_labelled(read_judgements(args.labels), args.small, args.large, args.labels,
                                          count_tokens=lambda text: _counter(args.tokenizer)(text))
            train, cal = hash_split(judged)
            source = {"source": "judgements", "file": args.labels, "small": args.small, "large": args.large,
                      **summary_dict(summary)}
            print(f"{args.labels}: {summary.prompts} prompts ({summary.both_engines} judged on both engines, "
                  f"{summary.small_only} on the small one only); left out: {summary.large_only_skipped} judged on "
                  f"the large one only, {summary.other_engine_lines} lines for other engines")
        else:
            folder = Path(args.labels)
            train, cal = load_labels(folder / "train.jsonl"), load_labels(folder / "calibration.jsonl")
            source = {"source": "suite", "folder": _rel(folder)}
            manifest = folder / "manifest.json"
            if manifest.is_file():
                m = json.loads(manifest.read_text())
                source.update(small=m.get("small"), large=m.get("large"), command=m.get("command"))
        if len(cal) < 2:
            raise ValueError(f"only {len(cal)} prompts held out for calibration; the file needs more prompts")
        art, _ = train_router(train, cal, C=C, target_large_share=args.target_large_share,
                              target_quality=args.target_quality, training=source, labels=objective,
                              **({} if args.folds is None else {"folds": args.folds}))
    except (OSError, ValueError) as e:
        print(f"tokenyard router train: {e}", file=sys.stderr)
        return 2
    save(art, args.out)
    print(f"wrote {args.out}: {len(train)} train / {len(cal)} calibration prompts ({objective}), threshold "
          f"{art.threshold:.4f} ({art.threshold_method} {art.threshold_target}), {len(art.indices)} weights")
    return 0


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{flag} expects NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _train_engines(args: argparse.Namespace, C: float) -> int:
    """N engines: the suite folder's pair plus each --engine file; --cost for every engine."""
    from tokenyard.router_models.runtime.engine_set import save
    from tokenyard.router_models.training.train_engines import engine_labels, train_engine_set

    out = (
        ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router_3.json" if args.out == str(ARTIFACT) else Path(args.out)
    )
    try:
        if args.traffic or Path(args.labels).is_file():
            raise ValueError("--engine trains from a suite label folder (--labels FOLDER)")
        if args.target_large_share is not None:
            raise ValueError("--target-large-share is a two-engine setting; use --cost-cap or --target-quality")
        extra = _pairs(args.engine, "--engine")
        costs = {k: float(v) for k, v in _pairs(args.cost, "--cost").items()}
        data = engine_labels(args.labels, extra)
        missing = [n for n in data["train"].names if n not in costs]
        if missing:
            raise ValueError(f"--cost missing for {', '.join(missing)}")
        es, _ = train_engine_set(data["train"], data["calibration"], costs, C=C,
                                 target_pgr=0.95 if args.target_quality is None else args.target_quality,
                                 cost_cap=args.cost_cap,
                                 training={"source": "suite", "folder": _rel(Path(args.labels)), "extra": extra})
    except (OSError, ValueError) as e:
        print(f"tokenyard router train: {e}", file=sys.stderr)
        return 2
    save(es, out)
    print(f"wrote {out}: engines {', '.join(es.names)} (costs {[e.cost for e in es.engines]}), default "
          f"{es.method} {es.quality_target if es.method == 'quality_target' else es.cost_cap}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from tokenyard.router_models.runtime.artifact import ArtifactError, load
    from tokenyard.router_models.training.evaluation import evaluate, plot
    from tokenyard.router_models.training.train import load_labels

    try:
        art = load(args.artifact)
        test = load_labels(args.test)
        report, curves = evaluate(art, test)
    except (OSError, ArtifactError, ValueError) as e:
        print(f"tokenyard router eval: {e}", file=sys.stderr)
        return 2
    report = {"artifact": _rel(Path(args.artifact)), "test": _rel(Path(args.test)), **report}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, curves, args.plot)
    print(format_summary(report))
    return 0


def format_summary(report: dict) -> str:
    lines = [f"test prompts {report['test_prompts']}: small {report['quality_small']:.3f}, "
             f"large {report['quality_large']:.3f}",
             "| routing | APGR | CPT(50%) | CPT(80%) | CPT(95%) | best accuracy |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in ("router", "random", "random_draw", "oracle"):
        s = report[name]
        lines.append(f"| {name} | {s['apgr']:.3f} | {s['cpt_50'] * 100:.1f}% | {s['cpt_80'] * 100:.1f}% | "
                     f"{s['cpt_95'] * 100:.1f}% | {s['max_quality']:.3f} |")
    ci = report.get("router_ci95")
    if ci:
        lines.append(f"router 95% bootstrap intervals ({ci['resamples']} resamples): APGR [{ci['apgr'][0]:.3f}, "
                     f"{ci['apgr'][1]:.3f}], CPT(80%) [{ci['cpt_80'][0] * 100:.1f}%, {ci['cpt_80'][1] * 100:.1f}%], "
                     f"CPT(95%) [{ci['cpt_95'][0] * 100:.1f}%, {ci['cpt_95'][1] * 100:.1f}%]")
    c = report["calibrated"]
    lines.append(f"calibrated threshold {c['threshold']:.4f} ({c['method']} target {c['target']}): "
                 f"{c['large_share'] * 100:.1f}% large calls on test, accuracy {c['quality']:.3f}")
    return "\n".join(lines)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenyard router")
    add_arguments(ap)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
