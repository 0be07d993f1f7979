"""Where W2's time goes in the engine: every step of one W2 run logged, and a profile of the
decode step at batch 96 split into linear layers, attention and the rest.

    .venv/bin/python -m tokenyard.bench.w2_profile [--profile-steps 5]

Same model and engine settings as tokenyard/bench/w2_throughput.py (random 30.9M Llama, fp32,
max_num_batched_tokens 2048, max_num_seqs 128, 1 GiB KV). Reported:
- the workload from tokenyard/bench/workloads.py: prompt and output tokens, and what transformers' static
  batches of 32 (left-padded, each running to its longest request) compute instead;
- step log of one run: steps that carry prefill chunks (their count, tokens, time, tokens/s and
  the linear layers' GFLOP/s there), decode-only steps (count, time, median step time by batch);
- torch profiler over `--profile-steps` decode steps with all 96 W2 requests decoding: self CPU
  time per step of matmul ops (linear layers), of attention ops (KV gather, SDPA, softmax, KV
  write) and of everything else;
- a decode step at batch 32 here vs in transformers' generate on the same weights (first 32
  W2 prompts; transformers' per-step time = (generate 33 tokens - generate 1) / 32).
Raw output: bench/results/w2_profile.json.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenyard.bench.random_checkpoint import build_random_checkpoint
from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.workloads import W2_MODEL, w2
from tokenyard.engines import LLM, SamplingParams

LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul")
ATTENTION_OPS = ("aten::index_select", "aten::index_copy_", "aten::index_copy", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_safe_softmax", "aten::softmax",
                 "aten::_softmax", "aten::bmm", "aten::baddbmm", "aten::index_put_", "aten::_index_put_impl_")


def workload_figures(reqs, batch: int = 32) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in reqs)
    out = sum(r.output_len for r in reqs)
    groups = [reqs[i:i + batch] for i in range(0, len(reqs), batch)]
    padded_prompt = sum(len(g) * max(len(r.prompt_token_ids) for r in g) for g in groups)
    padded_out = sum(len(g) * max(r.output_len for r in g) for g in groups)
    return {"requests": len(reqs), "prompt_tokens": prompt, "output_tokens": out,
            "static32_padded_prompt_tokens": padded_prompt, "static32_padded_output_tokens": padded_out,
            "static32_decode_steps": sum(max(r.output_len for r in g) for g in groups)}


def logged_run(llm: LLM, reqs) -> list[dict]:
    """One W2 run; per step: prefill tokens, decode rows, seconds."""
    engine = llm.engine
    schedule, step = engine.scheduler.schedule, engine.step
    log: list[dict] = []
    current: dict = {}

    def logged_schedule():
        batch = schedule()
        pre = sum(c.num_tokens for c in batch.chunks if c.seq.num_computed_tokens < c.seq.num_prompt_tokens)
        current.update(prefill_tokens=pre, prefill_rows=sum(1 for c in batch.chunks
                                                            if c.seq.num_computed_tokens < c.seq.num_prompt_tokens),
                       rows=len(batch.chunks))
        return batch

    def logged_step():
        current.clear()
        t0 = time.perf_counter()
        outs = step()
        if current.get("rows"):
            log.append({**current, "decode_rows": current["rows"] - current["prefill_rows"],
                        "s": time.perf_counter() - t0})
        return outs

    engine.scheduler.schedule, engine.step = logged_schedule, logged_step
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
        llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    finally:
        del engine.scheduler.schedule, engine.step
    return log


def step_figures(log: list[dict], linear_flops_per_token: float) -> dict:
    pre = [s for s in log if s["prefill_tokens"]]
    dec = [s for s in log if not s["prefill_tokens"]]
    pre_tokens = sum(s["prefill_tokens"] for s in pre)
    pre_s = sum(s["s"] for s in pre)
    bands = {"90-96": (90, 96), "60-89": (60, 89), "30-59": (30, 59), "1-29": (1, 29)}
    by_band = {}
    for name, (lo, hi) in bands.items():
        ts = [s["s"] for s in dec if lo <= s["decode_rows"] <= hi]
        if ts:
            by_band[name] = {"steps": len(ts), "median_ms": 1e3 * statistics.median(ts)}
    total = sum(s["s"] for s in log)
    return {"steps": len(log), "total_s": total,
            "prefill_steps": len(pre), "prefill_tokens": pre_tokens, "prefill_steps_s": pre_s,
            "prefill_share_of_time": pre_s / total, "prefill_tokens_per_s": pre_tokens / pre_s,
            "prefill_median_step_ms": 1e3 * statistics.median(s["s"] for s in pre),
            "prefill_linear_gflops": linear_flops_per_token * pre_tokens / pre_s / 1e9,
            "decode_only_steps": len(dec), "decode_only_s": sum(s["s"] for s in dec),
            "decode_step_ms_by_batch": by_band}


def _decode_ready(llm: LLM, prompts: list[list[int]], tag: str, max_tokens: int) -> None:
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while engine.scheduler.waiting or engine._inbox.num_new or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()


def _drain(llm: LLM, tag: str, n: int) -> None:
    for i in range(n):
        llm.engine.abort(f"{tag}{i}")
    while llm.engine.has_unfinished():
        llm.engine.step()


def profile_decode(llm: LLM, prompts: list[list[int]], steps: int) -> dict:
    """Self CPU time per decode step, by op class, with every prompt decoding."""
    _decode_ready(llm, prompts, "p", steps + 8)
    for _ in range(2):
        llm.engine.step()
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            llm.engine.step()
    wall = time.perf_counter() - t0
    _drain(llm, "p", len(prompts))
    split = {"linear": 0.0, "attention": 0.0, "rest": 0.0}
    ops = {}
    for ev in prof.key_averages():
        us = ev.self_cpu_time_total
        kind = "linear" if ev.key in LINEAR_OPS else "attention" if ev.key in ATTENTION_OPS else "rest"
        split[kind] += us
        ops[ev.key] = us
    top = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12])
    return {"batch": len(prompts), "steps": steps, "wall_ms_per_step_profiled": 1e3 * wall / steps,
            "self_cpu_ms_per_step": {k: v / 1e3 / steps for k, v in split.items()},
            "top_ops_ms_per_step": {k: v / 1e3 / steps for k, v in top.items()}}


def decode_step_ms_ours(llm: LLM, prompts: list[list[int]], steps: int = 20) -> float:
    _decode_ready(llm, prompts, "o", steps + 8)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.engine.step()
        ts.append(time.perf_counter() - t0)
    _drain(llm, "o", len(prompts))
    return 1e3 * statistics.median(ts)


def decode_step_ms_transformers(model_dir, prompts: list[list[int]], new: int = 33, rounds: int = 3) -> float:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1

    def gen(n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    gen(2)
    per_step = [(gen(new) - gen(1)) / (new - 1) for _ in range(rounds)]
    return 1e3 * statistics.median(per_step)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="bench/out/w2-llama-30m")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    rec = RunRecorder("w2_profile")
    model_dir = build_random_checkpoint(args.model_dir, "llama", seed=0, std=0.05, **W2_MODEL)
    reqs = w2(96, vocab_size=W2_MODEL["vocab_size"])
    # Prefix caching off, as in tokenyard/bench/w2_throughput.py: the warm-up and the profiled decode
    # reuse W2's prompts, which a warm cache would not prefill again.
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128, max_num_batched_tokens=2048,
              progress=False, enable_prefix_caching=False)
    # Linear layers every token passes through (the LM head runs only on sampled rows).
    linear_params = sum(m.weight.numel() for m in llm.engine.model.modules()
                        if isinstance(m, torch.nn.Linear) and m.weight.shape[0] != W2_MODEL["vocab_size"])
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    log = logged_run(llm, reqs)
    figures = {"workload": workload_figures(reqs), "linear_params_per_token": linear_params,
               "run": step_figures(log, 2.0 * linear_params)}
    print(figures["workload"], figures["run"], sep="\n", flush=True)
    figures["decode_profile_batch96"] = profile_decode(llm, prompts, args.profile_steps)
    print(figures["decode_profile_batch96"], flush=True)
    figures["decode_step_ms_batch32"] = {"tokenyard": decode_step_ms_ours(llm, prompts[:32]),
                                         "transformers": decode_step_ms_transformers(model_dir, prompts[:32])}
    print(figures["decode_step_ms_batch32"], flush=True)
    if not args.no_results:
        steps = [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()} for s in log
                 if s["prefill_tokens"]]
        rec.write(figures, steps, runs_note="runs: the steps that carried prefill chunks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
