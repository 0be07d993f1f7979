"""Exact-match accuracy of checkpoints on the task suite, run through the engine.

    tokenyard demo eval [--models models/demo-small models/demo-large] [--items 640] [--out x.json]
    tokenyard demo eval --items 96 --out bench/demo_sample_accuracy.json   # the record the tests check
    tokenyard demo eval --models tokenyard/models/demo-large --lora reverse=tokenyard/models/demo-large-lora/reverse

With --lora NAME=PATH (repeatable; one model) each adapter is measured as its own column,
"MODEL:NAME": the same items through an engine serving the adapter (lora_modules), every request
with lora=NAME, beside the base's column.

Every item goes through LLM.chat (the serving path: chat template, paged KV cache, continuous
batching, greedy sampling, detokeniser) and is judged by the suite's checker.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenyard.demo import task_suite
from tokenyard.engines import LLM, SamplingParams


def evaluate(model_dir: str | Path, items: list[task_suite.TaskItem], max_tokens: int = 48,
             use_tqdm: bool = True, lora: tuple[str, str | Path] | None = None,
             **engine_options) -> dict[str, dict[int, float]]:
    """{task: {level: accuracy}} plus task "all" -> {0: overall}. lora: (name, adapter folder) to
    answer every item with that adapter on the model."""
    if lora is not None:
        engine_options = {**engine_options, "lora_modules": {lora[0]: str(lora[1])}}
    llm = LLM(model_dir, progress=False, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, lora=lora[0] if lora else None)
    outs = llm.chat([list(it.messages) for it in items], params, use_tqdm=use_tqdm)
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


def measure(models: list[str | Path], n_items: int, seed: int, use_tqdm: bool = True,
            loras: dict[str, str | Path] | None = None, tasks: list[str] | None = None) -> dict:
    """The accuracy record `tokenyard demo eval --out` writes: the first n_items of the test split
    (seed; only `tasks` when given), each model through the engine with ENGINE_OPTIONS, and with
    `loras` (one model only) each adapter on it as a column "MODEL:NAME"."""
    if loras and len(models) != 1:
        raise ValueError(f"--lora adapters belong to one base model; got {len(models)} models ({', '.join(map(str, models))})")
    items = task_suite.generate_items("test", n_items, seed=seed, tasks=tasks)
    results = {Path(m).name: evaluate(m, items, use_tqdm=use_tqdm, **ENGINE_OPTIONS) for m in models}
    for name, path in (loras or {}).items():
        results[f"{Path(models[0]).name}:{name}"] = evaluate(models[0], items, use_tqdm=use_tqdm, lora=(name, path),
                                                            **ENGINE_OPTIONS)
    extra = {}
    if loras:
        extra = {"loras": {name: str(path) for name, path in loras.items()},
                 "task_accuracy": {col: {task: sum(levels.values()) / len(levels) for task, levels in table.items()
                                         if task != "all"} for col, table in results.items()}}
    return {"items": n_items, "seed": seed, "split": "test", "engine": dict(ENGINE_OPTIONS), **extra,
            **({"tasks": list(tasks)} if tasks else {}),
            "accuracy": {name: table["all"][0] for name, table in results.items()},
            "results": {name: {task: {str(level): acc for level, acc in levels.items()}
                               for task, levels in table.items()} for name, table in results.items()}}


def run(models: list[str], n_items: int, seed: int, out: Path | None, command: str = "",
        loras: dict[str, str] | None = None, tasks: list[str] | None = None) -> dict:
    record = measure(models, n_items, seed, loras=loras, tasks=tasks)
    print(markdown_table({name: {task: {int(lv): acc for lv, acc in levels.items()} for task, levels in table.items()}
                          for name, table in record["results"].items()}))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**record, "command": command}, indent=1) + "\n")
        print(f"wrote {out}")
    return record
