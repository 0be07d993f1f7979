"""Speculative decoding on the large demo model: prompt lookup and the small demo model as draft.

    .venv/bin/python -m tokenyard.bench.spec_bench [--items 48] [--per-task 12] [--out bench/out/spec_bench.json]

For each batch size (1, 4, 16) and method (none, ngram, draft) the same task-suite requests
(greedy, chat template, test split) run through the Engine with at most `batch` sequences at
once. Reported: output tokens/s over the whole run and over its decode steps only (steps with
no prefill chunk: the phase speculation acts on), speed-ups over no speculation, acceptance rate, tokens emitted
per verification, and the speed-up predicted from those and the measured costs:

    predicted = (S * E + P) / (S * (t_propose + t_verify) + P * t_decode) * t_decode

over the decode phase: S steps verified drafts and emitted E tokens per sequence each, P decode
steps found nothing to propose. t_decode: median time of a pure-decode step without
speculation at that batch size; t_propose, t_verify: mean time per speculative step spent
proposing and verifying (measured inside the engine). The measured decode speed-up is compared
with it (goal: >= 0.8x of the prediction). Then the per-task table at batch 1 (copy-like tasks are where prompt
lookup shines; the draft's benefit depends on how often the small model agrees with the large).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from tokenyard.demo import task_suite
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.text.tokenizer import Tokenizer

LARGE = "models/demo-large"
SMALL = "models/demo-small"
METHODS = {"none": {}, "ngram": {"speculative_method": "ngram"},
           "draft": {"speculative_method": "draft", "draft_model": SMALL}}


def prompts_for(items: list[task_suite.TaskItem]) -> list[list[int]]:
    tok = Tokenizer.from_dir(LARGE)
    return [tok.encode(apply_chat_template(tok, list(it.messages)), add_special_tokens=False) for it in items]


def run(prompts: list[list[int]], method: str, batch: int, k: int, max_tokens: int) -> dict:
    eng = Engine(LARGE, max_num_seqs=batch, kv_cache_memory=64 << 20, progress=False, num_speculative_tokens=k,
                 spec_max_batch=1024, **METHODS[method])  # forced on: this measures where it pays
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tokens = decode_tokens = 0
    decode_steps: list[float] = []
    t0 = time.perf_counter()
    while eng.has_unfinished():
        s0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - s0
        n = sum(len(o.new_token_ids) for o in outs)
        tokens += n
        st = eng.stats()
        # A decode (or verify) step: one scheduled token per running sequence, no prefill chunk in
        # it (the scheduler counts a verify chunk as its one decode token).
        if 0 < st.last_step_tokens <= batch and st.last_step_tokens == st.num_running + len(
                [o for o in outs if o.finished]):
            decode_steps.append(dt)
            decode_tokens += n
    wall = time.perf_counter() - t0
    res = {"method": method, "batch": batch, "tokens": tokens, "seconds": wall, "tok_s": tokens / wall,
           "decode_tok_s": decode_tokens / sum(decode_steps) if decode_steps else float("nan"),
           "decode_steps": len(decode_steps)}
    if method == "none":
        res["t_decode_ms"] = 1e3 * statistics.median(decode_steps) if decode_steps else float("nan")
    else:
        sp = eng.spec.stats
        steps = max(sp.num_spec_steps, 1)
        res.update(acceptance=sp.acceptance_rate, emitted_per_verify=sp.mean_accepted_length,
                   t_propose_ms=1e3 * sp.propose_seconds / steps, t_verify_ms=1e3 * sp.verify_seconds / steps,
                   spec_steps=sp.num_spec_steps)
    return res


def median_run(runs: list[dict]) -> dict:
    ranked = sorted(runs, key=lambda r: r["decode_tok_s"])
    return dict(ranked[len(ranked) // 2], repeats=len(runs))


def add_predictions(rows: list[dict]) -> None:
    base = {(r["batch"], r.get("task")): r for r in rows if r["method"] == "none"}
    for r in rows:
        b = base[(r["batch"], r.get("task"))]
        r["speedup"] = r["tok_s"] / b["tok_s"]
        r["decode_speedup"] = r["decode_tok_s"] / b["decode_tok_s"]
        if r["method"] != "none" and r["spec_steps"] == 0:
            r["predicted"] = r["measured_vs_predicted"] = float("nan")  # nothing was ever proposed
        elif r["method"] != "none":
            # Decode steps of the speculative run: S verified drafts (E tokens at t_propose +
            # t_verify each), the other P found nothing to propose (1 token at t_decode).
            S = r["spec_steps"]
            P = max(r["decode_steps"] - S, 0)
            tokens = S * r["emitted_per_verify"] + P
            cost = S * (r["t_propose_ms"] + r["t_verify_ms"]) + P * b["t_decode_ms"]
            r["predicted"] = (tokens / cost) * b["t_decode_ms"]
            r["measured_vs_predicted"] = r["decode_speedup"] / r["predicted"]


def table(rows: list[dict], key: str) -> str:
    lines = [f"| {key} | method | tok/s (all) | speed-up (all) | decode tok/s | decode speed-up | acceptance "
             f"| tokens/verify | t_propose ms | t_verify ms | predicted | measured/predicted |", "|" + " --- |" * 12]
    for r in rows:
        if r["method"] == "none":
            lines.append(f"| {r[key]} | none | {r['tok_s']:.0f} | 1.00x | {r['decode_tok_s']:.0f} | 1.00x | | "
                         f"| | decode {r['t_decode_ms']:.2f} | | |")
        else:
            lines.append(f"| {r[key]} | {r['method']} | {r['tok_s']:.0f} | {r['speedup']:.2f}x "
                         f"| {r['decode_tok_s']:.0f} | {r['decode_speedup']:.2f}x | {r['acceptance']:.2f} "
                         f"| {r['emitted_per_verify']:.2f} | {r['t_propose_ms']:.2f} | {r['t_verify_ms']:.2f} "
                         f"| {r['predicted']:.2f}x | {r['measured_vs_predicted']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=48, help="requests per (batch, method) run")
    ap.add_argument("--per-task", type=int, default=12, help="requests per task in the batch-1 task table")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16], help="mixed-task batch sizes (none: skip)")
    ap.add_argument("--tasks", nargs="+", help="only these tasks in the batch-1 task table")
    ap.add_argument("--results-name", help="raw results to bench/results/<name>.json (default spec_bench_k<k>)")
    ap.add_argument("--no-results", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; rows keep the median run")
    ap.add_argument("--out", default="bench/out/spec_bench.json")
    args = ap.parse_args(argv)
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.results_name or f"spec_bench_k{args.k}")
    items = task_suite.generate_items("test", args.items, seed=7)
    prompts = prompts_for(items)
    run(prompts[:4], "draft", 4, args.k, 8)  # warm-up: first-call allocations, lazy imports
    # Rounds interleave every (batch, method) run, and each row keeps the run with the median
    # decode tokens/s: a burst of other work on the machine then hits one round, not one method.
    jobs = [(b, m) for b in args.batches for m in METHODS]
    runs: dict[tuple[int, str], list[dict]] = {j: [] for j in jobs}
    for _ in tqdm(range(args.repeats), desc="rounds"):
        for b, m in jobs:
            runs[(b, m)].append(run(prompts, m, b, args.k, args.max_tokens))
    rows = [median_run(runs[j]) for j in jobs]
    add_predictions(rows)
    task_rows: list[dict] = []
    by_task: dict[str, list[task_suite.TaskItem]] = {}
    for it in task_suite.generate_items("test", args.per_task * 40, seed=8):
        if args.tasks and it.task not in args.tasks:
            continue
        if len(by_task.setdefault(it.task, [])) < args.per_task:
            by_task[it.task].append(it)
    for task, its in tqdm(sorted(by_task.items()), desc="tasks at batch 1"):
        p = prompts_for(its)
        for m in METHODS:
            r = median_run([run(p, m, 1, args.k, args.max_tokens) for _ in range(args.repeats)])
            r["task"] = task
            task_rows.append(r)
    add_predictions(task_rows)
    print(table(rows, "batch"))
    print()
    print(table(task_rows, "task"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"k": args.k, "max_tokens": args.max_tokens, "by_batch": rows,
                                          "by_task_batch1": task_rows}, indent=1))
    print(f"wrote {args.out}")
    if not args.no_results:
        rec.write({"by_batch": rows, "by_task_batch1": task_rows},
                  [{"batch": b, "method": m, "runs": rs} for (b, m), rs in runs.items()],
                  k=args.k, max_tokens=args.max_tokens, items=args.items, per_task=args.per_task,
                  repeats=args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
