"""Exact-match accuracy of checkpoints on the task suite, run through the engine.

    tokenyard demo eval [--models models/demo-small models/demo-large] [--items 640]

Every item goes through LLM.chat (the serving path: chat template, paged KV cache, continuous
batching, greedy sampling, detokeniser) and is judged by the suite's checker.
"""
from __future__ import annotations

import json
from pathlib import Path

from demo import task_suite
from engines import LLM, SamplingParams


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


def run(models: list[str], n_items: int, seed: int, out: Path | None) -> dict:
    items = task_suite.generate_items("test", n_items, seed=seed)
    results = {Path(m).name: evaluate(m, items) for m in models}
    print(markdown_table(results))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"items": n_items, "seed": seed, "split": "test", "results": results}, indent=1))
    return results
