"""W2 throughput: the engine's LLM.generate against transformers' generate with static batches.

    python -m tokenyard.bench.w2_throughput [--runs 3] [--requests 96] [--out bench/out/w2.json] [--cpu-compile on]

Both sides run the same random ~30M-parameter Llama in fp32 on the CPU with greedy decoding and
EOS ignored. The baseline takes requests in arrival order in static batches of 32, left-padded,
each batch running until its longest request ends; only requested tokens count as useful.
Runs are interleaved (ours, theirs, ours, ...) and the median of each is reported. Also printed:
the engine's per-step overhead outside the model forward at batch 1 and 64.
`--cpu-compile` sets the engine's cpu_compile knob (default off, the engine's default; `on` runs
pure-decode steps through the compiled graph, tokenyard/engines/model/compiled_decoder.py); the results file
is w2_throughput.json for off and w2_throughput_compiled.json for on/auto.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenyard.bench.random_checkpoint import build_random_checkpoint
from tokenyard.bench.workloads import W2_MODEL, Request, w2
from tokenyard.engines import LLM, SamplingParams


def run_ours(llm: LLM, reqs: list[Request]) -> float:
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outs, reqs))
    return elapsed


def run_transformers(model, reqs: list[Request], batch_size: int = 32) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[row, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[row, width - n:] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - t0


def step_overhead(llm: LLM, batch: int, vocab: int, steps: int = 20) -> dict[str, float]:
    """Mean ms per decode step spent outside the model forward (schedule, inputs, sampling)."""
    engine = llm.engine
    forward_time = [0.0]
    inner = engine.model.forward

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            forward_time[0] += time.perf_counter() - t

    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(f"oh{batch}-{i}", torch.randint(3, vocab, (64,), generator=g).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting \
            or engine._inbox.num_new:
        engine.step()  # finish all prefills first: measure pure decode steps
    engine.model.forward = timed
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        del engine.model.forward
    for i in range(batch):
        engine.abort(f"oh{batch}-{i}")
    while engine.has_unfinished():
        engine.step()
    return {"step_ms": 1e3 * total / steps, "forward_ms": 1e3 * forward_time[0] / steps,
            "overhead_ms": 1e3 * (total - forward_time[0]) / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--model-dir", default="bench/out/w2-llama-30m")
    ap.add_argument("--out", default="bench/out/w2.json")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--no-results", action="store_true", help="do not write bench/results/w2_throughput.json")
    ap.add_argument("--cpu-compile", default="off", choices=["off", "auto", "on"],
                    help="the engine's cpu_compile knob (EngineConfig)")
    ap.add_argument("--cpu-decode-step", default="auto", choices=["off", "auto", "on"],
                    help="the engine's cpu_decode_step knob (EngineConfig; auto: the C step for every decode batch, or 1-16 "
                         "beside a compiled graph)")
    ap.add_argument("--results-name", default=None, help="bench/results/<name>.json (default w2_throughput, "
                                                         "w2_throughput_compiled with --cpu-compile)")
    args = ap.parse_args()
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.results_name or ("w2_throughput" + ("" if args.cpu_compile == "off" else "_compiled")))

    model_dir = build_random_checkpoint(args.model_dir, "llama", seed=0, std=0.05, **W2_MODEL)
    reqs = w2(args.requests, vocab_size=W2_MODEL["vocab_size"])
    useful = sum(r.output_len for r in reqs)
    # Prefix caching off: the runs repeat the same prompts, and a warm cache would skip their
    # prefill from run 2 on (the baseline has no cache; W2's random prompts share no prefix).
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128,
              max_num_batched_tokens=args.max_num_batched_tokens, progress=False, enable_prefix_caching=False,
              cpu_compile=args.cpu_compile, cpu_decode_step=args.cpu_decode_step)
    params = sum(p.numel() for p in llm.engine.model.parameters())
    ref = None
    if not args.skip_baseline:
        import transformers
        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Warm-up on a few requests so one-time costs do not land in run 1.
    run_ours(llm, reqs[:4])
    if ref is not None:
        run_transformers(ref, reqs[:4])
    ours, theirs = [], []
    for i in range(args.runs):
        ours.append(run_ours(llm, reqs))
        print(f"run {i + 1}: engine {useful / ours[-1]:.1f} tok/s ({ours[-1]:.1f} s)", flush=True)
        if ref is not None:
            theirs.append(run_transformers(ref, reqs))
            print(f"run {i + 1}: transformers static-32 {useful / theirs[-1]:.1f} tok/s ({theirs[-1]:.1f} s)", flush=True)
    result = {
        "workload": f"W2: {len(reqs)} requests, input 32-512, output 16-256, all at once, ignore_eos",
        "model": f"random Llama, {params / 1e6:.1f}M parameters, fp32, CPU ({torch.get_num_threads()} threads)",
        "useful_output_tokens": useful,
        "engine_seconds": ours, "engine_tok_s": useful / statistics.median(ours),
        "max_num_batched_tokens": args.max_num_batched_tokens, "cpu_compile": args.cpu_compile,
        "compiled_steps": llm.engine.runner.num_compiled_steps, "cpu_decode_step": args.cpu_decode_step,
        "native_steps": llm.engine.runner.num_native_steps,
    }
    if theirs:
        result["transformers_seconds"] = theirs
        result["transformers_tok_s"] = useful / statistics.median(theirs)
        result["speedup"] = statistics.median(theirs) / statistics.median(ours)
    if llm.engine.runner.compiled is None:   # the overhead probe times the eager model.forward
        result["overhead_batch1"] = step_overhead(llm, 1, W2_MODEL["vocab_size"])
        result["overhead_batch64"] = step_overhead(llm, 64, W2_MODEL["vocab_size"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    if not args.no_results:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        figures = {k: v for k, v in result.items() if not k.endswith("_seconds")}
        figures.update(prompt_tokens=prompt_tokens, engine_median_s=statistics.median(ours),
                       transformers_median_s=statistics.median(theirs) if theirs else None)
        runs = [{"run": i + 1, "engine_s": o, "transformers_s": theirs[i] if theirs else None}
                for i, o in enumerate(ours)]
        rec.write(figures, runs)


if __name__ == "__main__":
    main()
