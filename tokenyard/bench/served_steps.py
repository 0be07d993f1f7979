"""Where the served ITL tail comes from: the W2 requests at 32 concurrent driven straight into the
engine (no HTTP, no gateway), every step timed and sorted by what it carried.

    .venv/bin/python -m tokenyard.bench.served_steps [--budgets 512,2048] [--concurrency 32] [--rounds 2]

The peer benchmark's served part (tokenyard/bench/peers/peer_bench.py) measures inter-token latency at the
client, through the gateway. This one takes the gateway away: a closed loop keeps `--concurrency`
requests in the engine (a new one is added as soon as one finishes, as the 32 streaming clients
do), and each request's inter-token gaps are taken from the wall clock of the steps that emitted its
tokens. If the engine's own ITL p99 is well under the client's, the tail is the gateway's; if not,
the step table says which steps make it:
- decode-only steps (pure decode: the C step), by count and time percentiles;
- mixed steps (decode rows beside prefill chunks: one eager torch forward), by count, time
  percentiles and prefill tokens carried;
- per budget (`B` or `B:burst`: max_num_batched_tokens B and prefill_burst_tokens burst, the
  engine's default when left out, 0 off; each an engine of its own, built once, rounds interleaved):
  ITL p50/p99 and TTFT p50/p99 over all requests, and output tok/s.
Engine settings are the peer benchmark's fp32_default (tokenyard/bench/peers/peer_bench.py): the W2 checkpoint
in fp32, 1 GiB KV, max_num_seqs 128, prefix caching off, EOS ignored.
Raw output: bench/results/<--results-name, default served_steps>.json.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tokenyard.bench.peers.models import w2_checkpoint
from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.serving_metrics import percentile as pct
from tokenyard.bench.workloads import W2_MODEL, w2
from tokenyard.engines import LLM, SamplingParams


def closed_loop(llm: LLM, reqs: list, concurrency: int) -> dict[str, Any]:
    """Run every request with at most `concurrency` in the engine at once; time each step."""
    eng = llm.engine
    pending = list(enumerate(reqs))
    live: dict[str, dict] = {}
    done: list[dict] = []
    steps: list[dict] = []

    def admit() -> None:
        while pending and len(live) < concurrency:
            i, r = pending.pop(0)
            rid = f"r{i}"
            eng.add_request(rid, list(r.prompt_token_ids),
                            SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
            live[rid] = {"added": time.perf_counter(), "times": []}

    # What each step carries, seen where the runner gets it: sequences, tokens, prompt chunks.
    carried: list[dict] = []
    execute = eng.runner.execute

    def recording_execute(batch: Any) -> list[int]:
        prefill = [c.num_tokens for c in batch.chunks if c.seq.num_computed_tokens < c.seq.num_prompt_tokens]
        carried.append({"seqs": len(batch.chunks), "tokens": batch.num_tokens, "prefilling": len(prefill),
                        "prefill_tokens": sum(prefill)})
        return execute(batch)

    eng.runner.execute = recording_execute
    t_start = time.perf_counter()
    admit()
    while live:
        carried.clear()
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        if carried:
            steps.append({"s": t1 - t0, **carried[0]})
        for o in outs:
            st = live.get(o.request_id)
            if st is None:
                continue
            st["times"].extend([t1] * len(o.new_token_ids))
            if o.finished:
                done.append(live.pop(o.request_id))
        admit()
    wall = time.perf_counter() - t_start
    del eng.runner.execute        # the bound method again
    itl = [b - a for st in done for a, b in zip(st["times"], st["times"][1:])]
    ttft = [st["times"][0] - st["added"] for st in done if st["times"]]
    decode = [s["s"] for s in steps if s["prefilling"] == 0]
    mixed = [s for s in steps if s["prefilling"] > 0]
    return {
        "wall_s": wall, "step_s": sum(s["s"] for s in steps), "output_tok_s": sum(len(st["times"]) for st in done) / wall,
        "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3, "itl_max_ms": max(itl) * 1e3,
        "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "decode_steps": len(decode), "decode_step_p50_ms": pct(decode, 50) * 1e3,
        "decode_step_p99_ms": pct(decode, 99) * 1e3,
        "mixed_steps": len(mixed), "mixed_step_p50_ms": pct([s["s"] for s in mixed], 50) * 1e3,
        "mixed_step_p99_ms": pct([s["s"] for s in mixed], 99) * 1e3,
        "mixed_step_max_ms": max((s["s"] for s in mixed), default=float("nan")) * 1e3,
        "mixed_tokens_p50": pct([s["tokens"] for s in mixed], 50),
        "mixed_tokens_max": max((s["tokens"] for s in mixed), default=0),
        "mixed_prefill_tokens_p50": pct([s["prefill_tokens"] for s in mixed], 50),
        "mixed_share_of_itl": len(mixed) / max(1, len(steps)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="512,2048",
                    help="comma-separated max_num_batched_tokens[:prefill_burst_tokens] (burst left out: the engine's "
                         "default, off)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-name", default="served_steps")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rec = RunRecorder(args.results_name)
    reqs = w2(args.requests, vocab_size=W2_MODEL["vocab_size"])
    model_dir = w2_checkpoint()
    budgets = args.budgets.split(",")

    def engine(spec: str) -> LLM:
        tokens, _, burst = spec.partition(":")
        extra = {"prefill_burst_tokens": int(burst)} if burst else {}
        return LLM(model_dir, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128,
                   max_num_batched_tokens=int(tokens), progress=False, enable_prefix_caching=False, **extra)

    engines = {b: engine(b) for b in budgets}
    for llm in engines.values():   # warm-up: one-time costs stay out of round 1
        closed_loop(llm, reqs[:4], 4)
    runs: dict[str, list[dict]] = {b: [] for b in budgets}
    for rnd in range(args.rounds):
        for b in budgets:
            r = closed_loop(engines[b], reqs, args.concurrency)
            runs[b].append(r)
            print(f"round {rnd + 1} budget {b}: ITL p50 {r['itl_p50_ms']:.0f} p99 {r['itl_p99_ms']:.0f} ms, "
                  f"TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms, {r['output_tok_s']:.0f} tok/s; "
                  f"decode steps {r['decode_steps']} p50 {r['decode_step_p50_ms']:.0f} ms, mixed {r['mixed_steps']} "
                  f"p50 {r['mixed_step_p50_ms']:.0f} p99 {r['mixed_step_p99_ms']:.0f} max {r['mixed_step_max_ms']:.0f} ms "
                  f"({r['mixed_tokens_p50']:.0f} tokens p50, {r['mixed_tokens_max']} max)", flush=True)
    runner = next(iter(engines.values())).engine.runner
    figures = {"concurrency": args.concurrency, "requests": len(reqs), "threads": args.threads,
               # eager linears on oneDNN's packed weights (cpu_onednn_linear; TOKENYARD_CPU_ONEDNN_LINEAR)
               "cpu_onednn_linear": {"mode": runner.cpu_onednn_linear_mode, "layers": runner.num_onednn_linears,
                                     "measured_speedup": runner.onednn_speedup},
               "by_budget": {b: {k: statistics.median(r[k] for r in runs[b]) for k in runs[b][0]}
                             for b in budgets}}
    rec.write(figures, runs=[{"budget": b, **r} for b in budgets for r in runs[b]])


if __name__ == "__main__":
    main()
