"""`tokenyard demo ...`: train, evaluate and plot the demo model pair."""
from __future__ import annotations

import argparse
import shlex
import tempfile
from pathlib import Path

DEFAULT_MODELS = Path(__file__).resolve().parent.parent.parent / "models"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="demo_command", required=True)
    tr = sub.add_parser("train", help="train (or continue training) the demo small/large models")
    tr.add_argument("--which", choices=["small", "large", "both"], default="both")
    tr.add_argument("--steps-small", type=int, default=3000)
    tr.add_argument("--steps-large", type=int, default=3000)
    tr.add_argument("--minutes", type=float, help="stop each model after this many minutes (resume later)")
    tr.add_argument("--run-dir", default=".tokenyard/train", help="training state, kept for --resume")
    tr.add_argument("--out", default=str(DEFAULT_MODELS), help="where demo-small/ and demo-large/ are written")
    tr.add_argument("--smoke", action="store_true", help="a few steps into a temporary folder (tests)")
    tr.set_defaults(func=_train)
    ev = sub.add_parser("eval", help="exact-match accuracy per task and level, through the engine")
    ev.add_argument("--models", nargs="+", default=[str(DEFAULT_MODELS / "demo-small"), str(DEFAULT_MODELS / "demo-large")])
    ev.add_argument("--items", type=int, default=640)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--out", default="bench/out/demo_eval.json")
    ev.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="also measure this LoRA adapter on the (one) model, as column MODEL:NAME (repeatable)")
    ev.add_argument("--tasks", nargs="+", help="only these task families (default: all)")
    ev.set_defaults(func=_eval)
    tl = sub.add_parser("train-lora", help="train a small LoRA adapter of a demo model on one task family")
    from tokenyard.demo.train_lora import add_arguments as lora_arguments
    lora_arguments(tl)
    tl.set_defaults(func=_train_lora)
    pl = sub.add_parser("plot", help="learning curves PNG from the training runs")
    pl.add_argument("--run-dir", default=".tokenyard/train")
    pl.add_argument("--out", default="bench/demo_learning_curves.png")
    pl.set_defaults(func=_plot)


def _train(args: argparse.Namespace) -> int:
    from tokenyard.demo.train import SPECS, TrainConfig, train

    run_root, out_root = Path(args.run_dir), Path(args.out)
    tmp = None
    if args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="tokenyard-smoke-")
        run_root = out_root = Path(tmp.name)
    which = ["small", "large"] if args.which == "both" else [args.which]
    for name in which:
        steps = args.steps_small if name == "small" else args.steps_large
        cfg = TrainConfig(steps=steps)
        if args.smoke:
            cfg = TrainConfig(steps=3, batch_size=4, eval_every=3, checkpoint_every=3, eval_items=16, train_pool=64,
                              tokenizer_corpus=2000, vocab_size=600, warmup=1)
        train(SPECS[name], run_root / name, out_root / f"demo-{name}", run_root / "tokenizer", cfg,
              minutes=args.minutes, progress=not args.smoke)
        print(f"wrote {out_root / f'demo-{name}'}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def _eval(args: argparse.Namespace) -> int:
    from tokenyard.demo.evaluate import run

    loras = {}
    for spec in args.lora:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora wants NAME=PATH, got {spec!r}")
        loras[name] = path
    if loras and len(args.models) != 1:
        raise SystemExit("--lora adapters belong to one base: give that one model with --models")
    run(args.models, args.items, args.seed, Path(args.out) if args.out else None, _eval_command(args), loras=loras,
        tasks=args.tasks)
    return 0


def _train_lora(args: argparse.Namespace) -> int:
    from tokenyard.demo.train_lora import run

    return run(args)


def _eval_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this record (written into it; default models left out)."""
    parts = ["tokenyard", "demo", "eval"]
    defaults = [str(DEFAULT_MODELS / "demo-small"), str(DEFAULT_MODELS / "demo-large")]
    if [str(Path(m).resolve()) for m in args.models] != defaults:
        parts += ["--models", *map(shlex.quote, args.models)]
    parts += [f"--lora={shlex.quote(spec)}" for spec in args.lora]
    if args.tasks:
        parts += ["--tasks", *args.tasks]
    parts += ["--items", str(args.items), "--seed", str(args.seed)]
    if args.out:
        parts += ["--out", shlex.quote(args.out)]
    return " ".join(parts)


def _plot(args: argparse.Namespace) -> int:
    from tokenyard.demo.plots import plot_learning_curves

    root = Path(args.run_dir)
    print(plot_learning_curves({"small": root / "small", "large": root / "large"}, Path(args.out)))
    return 0
