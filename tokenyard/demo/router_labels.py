"""Router labels: run the demo small and large engines on task-suite prompts and record who wins.

    python -m tokenyard.demo.router_labels                       # the committed label set (tokenyard/router_models/data/)
    python -m tokenyard.demo.router_labels --pilot 200           # measure items/s first, write nothing
    python -m tokenyard.demo.router_labels --reuse tokenyard/router_models/data   # run the engines only on new prompts

A prompt is labelled 1 ("small is enough") when the small engine's answer is as good as the
large one's by the suite's checker: the small one is correct, or both are wrong. Else 0.

Splits (each uniform over tasks x levels: equal counts per (task, level) cell):
  train        suite split "validation", inputs in hash half A, phrasings 0-2 only
  calibration  suite split "validation", inputs in hash half B, phrasings 0-3
  test         suite split "test",       phrasings 0-2, and 4-5 in place of 3
Phrasing 3 (the suite's held-out wording) is never in the router's train split; calibration has
it (the router may learn from it what unfamiliar wording implies). The test split's items drawn
in phrasing 3 are re-worded in phrasing 4 or 5 (task_suite.ROUTER_TEST_PHRASINGS, by a stable
hash of the input), wording that no model, tokenizer or router ever trains or calibrates on. The halves
are a stable hash of the input without its wording (`input_key`), so one input lies in one
half only; the suite's splits are disjoint in their inputs, so no test input is trained on
or calibrated on. The suite's own "train" split is not used: the demo models were trained on
200,000 items from it, so the small model's answers there measure memorisation, not traffic
the router will see.

The small engine runs as it is served: weight-only int8 (`quantization="int8"`) when the
engine supports it; the choice is recorded in tokenyard/router_models/data/manifest.json. Replies are
greedy (temperature 0), through `LLM.chat` (chat template, batching, detokeniser), the same
path as `tokenyard demo eval`.

Each JSONL line: id, split, task, level, phrasing, messages, prompt (the text the router
scores: message contents joined by newlines, see tokenyard.router_models.runtime.features.prompt_text),
prompt_tokens (chat-templated prompt length with the serving tokenizer, what the gateway
counts), answer, small_reply, large_reply, small_correct, large_correct, label.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
import zlib
from pathlib import Path

from tokenyard.demo import task_suite
from tokenyard.router_models.runtime.features import prompt_text

ROOT = Path(__file__).resolve().parent.parent.parent
MODELS = ROOT / "models"
OUT = ROOT / "tokenyard" / "router_models" / "data"
SPLITS = {"train": "validation", "calibration": "validation", "test": "test"}
DEFAULT_SIZES = {"train": 3600, "calibration": 2200, "test": 2200}
SEED = 12
MAX_TOKENS = 48


_NAME = re.compile(r"\b[A-Z][aeiou][a-z][aeiou][a-z][aeiou]\b")  # the suite's made-up CVCVCV names


def input_key(item: task_suite.TaskItem) -> str:
    """What an item asks about, without its wording: task, numbers, the text after the last
    colon (every list-shaped input sits there) and fact names; equal inputs give equal keys."""
    text = item.user_text
    tail = text.rsplit(":", 1)[1] if ":" in text else ""
    return "|".join([item.task, " ".join(re.findall(r"\d+", text)), tail.strip(), " ".join(_NAME.findall(text))])


def test_wording(item: task_suite.TaskItem) -> task_suite.TaskItem:
    """A test item in the held-out phrasing 3 re-worded in phrasing 4 or 5 (a stable hash of its
    input picks which); other items unchanged."""
    if item.phrasing != task_suite.HELD_OUT_PHRASING:
        return item
    new = task_suite.ROUTER_TEST_PHRASINGS
    return task_suite.rephrase(item, new[zlib.crc32(input_key(item).encode()) % len(new)])


def half_of(item: task_suite.TaskItem) -> str:
    """"train" or "calibration": a stable hash of the item's input (never of its wording)."""
    return ("train", "calibration")[zlib.crc32(input_key(item).encode()) % 2]


def draw_items(sizes: dict[str, int], seed: int) -> dict[str, list[task_suite.TaskItem]]:
    """Per split, `sizes[name]` items with counts per (task, level) cell differing by at most one."""
    cells = [(t, lv) for t in task_suite.TASKS for lv in task_suite.LEVELS]
    out: dict[str, list[task_suite.TaskItem]] = {}
    for name, n in sizes.items():
        quota = {c: n // len(cells) + (i < n % len(cells)) for i, c in enumerate(cells)}
        picked: dict[tuple[str, int], list[task_suite.TaskItem]] = {c: [] for c in cells}
        for cell in cells:
            if SPLITS[name] == "test":
                picked[cell] = [test_wording(it) for it in
                                task_suite.generate_items("test", quota[cell], seed, [cell[0]], [cell[1]])]
                continue
            stream = task_suite.generate_items(SPLITS[name], 6 * quota[cell] + 100, seed, [cell[0]], [cell[1]])
            for it in stream:
                if len(picked[cell]) == quota[cell]:
                    break
                if half_of(it) == name and (name != "train" or it.phrasing != task_suite.HELD_OUT_PHRASING):
                    picked[cell].append(it)
            if len(picked[cell]) < quota[cell]:
                raise RuntimeError(f"{name}: cell {cell} has only {len(picked[cell])} of {quota[cell]} items")
        # Interleave cells round by round (a prefix stays uniform), deterministically.
        rng = random.Random(f"{seed}|{name}")
        items: list[task_suite.TaskItem] = []
        for r in range(max(quota.values())):
            round_cells = [c for c in cells if r < quota[c]]
            rng.shuffle(round_cells)
            items.extend(picked[c][r] for c in round_cells)
        out[name] = items
    return out


def small_engine_options(quantization: str) -> dict:
    return {} if quantization == "none" else {"quantization": quantization}


def detect_quantization() -> str:
    """"int8" when the engine accepts it (the small model is served that way), else "none"."""
    try:
        from tokenyard.engines.core.config import EngineConfig
        EngineConfig.from_options({"quantization": "int8"})
        return "int8"
    except (TypeError, ValueError):
        return "none"


def reusable_replies(folder: Path) -> dict[str, dict]:
    """Earlier label rows by their messages: the engines are deterministic (greedy), so a prompt
    labelled before need not run again (`--reuse`)."""
    out = {}
    for path in sorted(Path(folder).glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    out[json.dumps(row["messages"])] = row
    return out


def run_model(model_dir: Path, items: list[task_suite.TaskItem], desc: str, **options) -> list[str]:
    from tokenyard.engines import LLM, SamplingParams

    if not items:
        return []
    llm = LLM(model_dir, progress=False, kv_cache_memory=256 << 20, **options)
    print(f"{desc}: {len(items)} items", flush=True)
    outs = llm.chat([list(it.messages) for it in items], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                    use_tqdm=True)
    return [o.outputs[0].text for o in outs]


def count_prompt_tokens(items: list[task_suite.TaskItem]) -> list[int]:
    from tokenyard.engines.text.chat_template import apply_chat_template
    from tokenyard.engines.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(MODELS / "demo-small")
    return [len(tok.encode(apply_chat_template(tok, list(it.messages), add_generation_prompt=True),
                           add_special_tokens=False)) for it in items]


def label_rows(split_name: str, items: list[task_suite.TaskItem], small: list[str], large: list[str],
               tokens: list[int]) -> list[dict]:
    rows = []
    for i, (it, s, l, n) in enumerate(zip(items, small, large, tokens)):
        sc, lc = it.check(s), it.check(l)
        rows.append({"id": f"{split_name}-{i}", "split": split_name, "task": it.task, "level": it.level,
                     "phrasing": it.phrasing, "messages": [dict(m) for m in it.messages],
                     "prompt": prompt_text(it.messages), "prompt_tokens": n, "answer": it.answer,
                     "small_reply": s, "large_reply": l, "small_correct": sc, "large_correct": lc,
                     "label": int(sc or not lc)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--train", type=int, default=DEFAULT_SIZES["train"])
    ap.add_argument("--calibration", type=int, default=DEFAULT_SIZES["calibration"])
    ap.add_argument("--test", type=int, default=DEFAULT_SIZES["test"])
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--quantization", choices=["auto", "none", "int8"], default="auto",
                    help="small engine weights (auto: int8 when the engine supports it)")
    ap.add_argument("--pilot", type=int, default=0, help="time N test items per model and exit")
    ap.add_argument("--reuse", help="folder of earlier label files: prompts found there keep their replies "
                                    "and token counts, only the others run through the engines")
    args = ap.parse_args(argv)
    quant = detect_quantization() if args.quantization == "auto" else args.quantization
    sizes = {"train": args.train, "calibration": args.calibration, "test": args.test}
    if args.pilot:
        sizes = {"test": args.pilot}
    items = draw_items(sizes, args.seed)
    flat = [it for name in sizes for it in items[name]]
    known = reusable_replies(Path(args.reuse)) if args.reuse and not args.pilot else {}
    old = [known.get(json.dumps([dict(m) for m in it.messages])) for it in flat]
    todo = [it for it, row in zip(flat, old) if row is None]
    timings = {}
    t0 = time.perf_counter()
    new_small = run_model(MODELS / "demo-small", todo, f"demo-small ({quant})", **small_engine_options(quant))
    timings["small_items_per_s"] = len(todo) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    new_large = run_model(MODELS / "demo-large", todo, "demo-large")
    timings["large_items_per_s"] = len(todo) / (time.perf_counter() - t0)
    new_tokens = count_prompt_tokens(todo)
    fresh = iter(zip(new_small, new_large, new_tokens))
    small, large, tokens = [], [], []
    for row in old:
        s, l, n = (row["small_reply"], row["large_reply"], row["prompt_tokens"]) if row else next(fresh)
        small.append(s)
        large.append(l)
        tokens.append(n)
    print(json.dumps({k: round(v, 1) for k, v in timings.items()}))
    out = Path(args.out)
    summary = {}
    start = 0
    for name in sizes:
        n = len(items[name])
        rows = label_rows(name, items[name], small[start:start + n], large[start:start + n],
                          tokens[start:start + n])
        start += n
        summary[name] = {"items": n, "small_acc": sum(r["small_correct"] for r in rows) / n,
                         "large_acc": sum(r["large_correct"] for r in rows) / n,
                         "label_1_share": sum(r["label"] for r in rows) / n}
        if not args.pilot:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(json.dumps(summary, indent=1))
    if not args.pilot:
        args_text = " ".join(sys.argv[1:] if argv is None else argv)
        manifest = {"command": f"python -m tokenyard.demo.router_labels {args_text}".strip(), "seed": args.seed,
                    "small": {"model": "models/demo-small", "quantization": quant},
                    "large": {"model": "models/demo-large", "quantization": "none"},
                    "max_tokens": MAX_TOKENS, "suite_splits": SPLITS, "summary": summary,
                    "items_per_s": {k: round(v, 1) for k, v in timings.items()},
                    "engine_runs": len(todo), "reused_rows": len(flat) - len(todo)}
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
