"""Exact-match accuracy of the committed demo pair on the task suite, with raw results.

    .venv/bin/python -m tokenyard.bench.demo_eval [--items 640] [--seed 0]
    .venv/bin/python -m tokenyard.bench.demo_eval --models models/demo-large --lora reverse=models/demo-large-lora/reverse \
        --lora add=models/demo-large-lora/add --tasks reverse add --items 160 --name demo_lora_eval   # adapters

The measurement is `tokenyard demo eval` (tokenyard.demo.evaluate.measure: every item through LLM.chat,
greedy, judged by the suite's checker); this adds the easy (levels 1-2) and hard (levels 3-4)
means and writes bench/results/demo_eval.json. Accuracy does not depend on the machine's load.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tokenyard.bench.results_io import RunRecorder

ROOT = Path(__file__).resolve().parent.parent.parent
MODELS = (ROOT / "models" / "demo-small", ROOT / "models" / "demo-large")


def level_means(table: dict[str, dict[str, float]], levels: tuple[str, ...]) -> float:
    """Mean over tasks x the given levels (every cell has the same number of items)."""
    cells = [acc for task, by_level in table.items() if task != "all" for lv, acc in by_level.items() if lv in levels]
    return sum(cells) / len(cells)


def model_facts(model_dir: Path) -> dict:
    """Parameters and layout of a committed checkpoint (from its files, not from memory)."""
    import json
    import math

    from safetensors import safe_open
    cfg = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fh:
        params = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
            "vocab_size", "max_position_embeddings")
    return {"parameters": params, **{k: cfg.get(k) for k in keys}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=640)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", nargs="+", type=Path, default=list(MODELS))
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                    help="a LoRA adapter of the (one) model, evaluated as the column MODEL:NAME")
    ap.add_argument("--tasks", nargs="+", default=None, help="only these task families")
    ap.add_argument("--name", default="demo_eval", help="the results file's name")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    from tokenyard.demo.evaluate import markdown_table, measure
    loras = dict(x.split("=", 1) for x in args.lora)
    rec = RunRecorder(args.name)
    record = measure(list(args.models), args.items, args.seed, use_tqdm=False, loras=loras or None, tasks=args.tasks)
    figures = {"items": record["items"], "seed": record["seed"], "accuracy": record["accuracy"],
               "easy_levels_1_2": {m: level_means(t, ("1", "2")) for m, t in record["results"].items()},
               "hard_levels_3_4": {m: level_means(t, ("3", "4")) for m, t in record["results"].items()},
               "by_task_level": record["results"],
               "models": {Path(m).name: model_facts(Path(m)) for m in args.models}}
    for key in ("loras", "task_accuracy", "tasks"):
        if key in record:
            figures[key] = record[key]
    print(markdown_table({name: {task: {int(lv): acc for lv, acc in levels.items()} for task, levels in table.items()}
                          for name, table in record["results"].items()}))
    print({k: figures[k] for k in ("accuracy", "easy_levels_1_2", "hard_levels_3_4")})
    if not args.no_results:
        rec.write(figures, [], engine=record["engine"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
