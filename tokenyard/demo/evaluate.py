"""Exact-match accuracy of checkpoints on the task suite, run through the engine.

    tokenyard demo eval [--models models/demo-small models/demo-large] [--items 640] [--out x.json]
    tokenyard demo eval --items 96 --out bench/demo_sample_accuracy.json   # the record the tests check

Every item goes through LLM.chat (the serving path: chat template, paged KV cache, continuous
batching, greedy sampling, detokeniser) and is judged by the suite's checker.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenyard.demo import task_suite
from tokenyard.engines import LLM, SamplingParams


def evaluate(model_dir: str | Path, items: list[task_suite.TaskItem], max_tokens: int = 48,
             use_tqdm: bool = True, **engine_options) -> dict[str, dict[int, float]]:
    """{task: {level: accuracy}} plus task "all" -> {0: overall}."""
    llm = LLM(model_dir, progress=False, **engine_options)
    outs = llm.chat([list(it.messages) for it in items], SamplingParams(temperature=0.0, max_tokens=max_tokens),
                    use_tqdm=use_tqdm)
    hits: dict[tuple[str, int], list[int]] = {}
    for it, out in zip(items, outs):
        hits.setdefault((it.task, it.level), []).append(int(it.check(out.outputs[0].text)))
    table: dict[str, dict[int, float]] = {}
    for (task, level), v in sorted(hits.items()):
        table.setdefault(task, {})[level] = sum(v) / len(v)
    flat = [x for v in hits.values() for x in v]
    table["all"] = {0: sum(flat) / len(flat)}
    return table


def markdown_table(results: dict[str, dict[str, dict[int, float]]]) -> str:
    """Rows: task x level; one column per model."""
    names = list(results)
    lines = ["| task | level | " + " | ".join(names) + " |", "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    first = results[names[0]]
    for task in [t for t in first if t != "all"]:
        for level in first[task]:
            cells = " | ".join(f"{results[n][task][level]:.2f}" for n in names)
            lines.append(f"| {task} | {level} | {cells} |")
    lines.append("| **all** | | " + " | ".join(f"**{results[n]['all'][0]:.3f}**" for n in names) + " |")
    return "\n".join(lines)


# The engine settings every recorded accuracy is measured with (and re-measured with in the tests).
ENGINE_OPTIONS = {"kv_cache_memory": 64 << 20}


def measure(models: list[str | Path], n_items: int, seed: int, use_tqdm: bool = True) -> dict:
    """The accuracy record `tokenyard demo eval --out` writes: the first n_items of the test split
    (seed), each model through the engine with ENGINE_OPTIONS."""
    items = task_suite.generate_items("test", n_items, seed=seed)
    results = {Path(m).name: evaluate(m, items, use_tqdm=use_tqdm, **ENGINE_OPTIONS) for m in models}
    return {"items": n_items, "seed": seed, "split": "test", "engine": dict(ENGINE_OPTIONS),
            "accuracy": {name: table["all"][0] for name, table in results.items()},
            "results": {name: {task: {str(level): acc for level, acc in levels.items()}
                               for task, levels in table.items()} for name, table in results.items()}}


def run(models: list[str], n_items: int, seed: int, out: Path | None, command: str = "") -> dict:
    record = measure(models, n_items, seed)
    print(markdown_table({name: {task: {int(lv): acc for lv, acc in levels.items()} for task, levels in table.items()}
                          for name, table in record["results"].items()}))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**record, "command": command}, indent=1) + "\n")
        print(f"wrote {out}")
    return record
