"""SmolLM2-135M-Instruct served from its GGUF: load, memory, prefill, decode, agreement and a short
serving run through the gateway, on this CPU.

    .venv/bin/python -m tokenyard.bench.smollm2_bench [--only load speed agree serve] [--prompts 200]

- load: each mode is loaded in a fresh process (the GGUF reader's parse is cached per process), once
  with the file evicted from the page cache (cold, posix_fadvise DONTNEED) and once right after
  (warm); the process's peak RSS after the load is its memory.
- speed: prefill tok/s of a 512-token prompt (max_tokens 1) and batch-1 greedy decode tok/s (64 new
  tokens minus a 1-token request with the same prefill), median of `--repeats`, modes interleaved.
- agree: greedy replies (32 tokens) of the int4 engine vs the dequantised fp32 engine on `--prompts`
  task-suite chat prompts: exact matches, and the mean share of the reply before they diverge.
- serve: `tokenyard serve` with the smollm2-135m engine alone (int4), 32 task-suite chats, 4 in
  flight, streamed: TTFT and TPOT percentiles as the client saw them.

Writes bench/results/smollm2.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .results_io import RunRecorder

MODES = {"int4_from_q4_1": dict(quantization="int4", quant_group_size=32, dtype="float32"),
         "dequantised_fp32": dict(quantization="none", dtype="float32"),
         "dequantised_bf16": dict(quantization="none", dtype="bfloat16")}
ROOT = Path(__file__).resolve().parents[2]

_LOAD_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from tokenyard.engines import LLM
kw = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], kv_cache_memory=64 << 20, progress=False, **kw)
load_s = time.perf_counter() - t0
print(json.dumps({"load_s": load_s, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _load_once(path: Path, kw: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(path), json.dumps(kw)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_load(path: Path, repeats: int) -> tuple[dict, list]:
    runs = []
    for r in range(repeats):
        for name, kw in MODES.items():
            _evict(path)
            cold = _load_once(path, kw)
            warm = _load_once(path, kw)
            runs.append({"mode": name, "repeat": r, "cold_load_s": cold["load_s"], "warm_load_s": warm["load_s"],
                         "peak_rss_mib": warm["peak_rss_mib"]})
            print(f"load {name} #{r}: cold {cold['load_s']:.2f} s, warm {warm['load_s']:.2f} s, "
                  f"peak RSS {warm['peak_rss_mib']:.0f} MiB", flush=True)
    figures = {}
    for name in MODES:
        mine = [x for x in runs if x["mode"] == name]
        figures[name] = {k + "_median": statistics.median(x[k] for x in mine)
                         for k in ("cold_load_s", "warm_load_s", "peak_rss_mib")}
    return figures, runs


def _prompt_of(tok, n: int) -> list[int]:
    words = ("the lighthouse keeper watched the grey sea while ships passed slowly toward the harbour " * 200).split()
    ids = tok.encode(" ".join(words), add_special_tokens=False)
    return ids[:n]


def bench_speed(path: Path, repeats: int, prefill_tokens: int = 512, decode_tokens: int = 64) -> tuple[dict, list]:
    from tokenyard.engines import LLM, SamplingParams
    llms = {name: LLM(str(path), kv_cache_memory=64 << 20, max_num_batched_tokens=1024, progress=False,
                      enable_prefix_caching=False, **kw) for name, kw in MODES.items()}
    prompt = _prompt_of(next(iter(llms.values())).tokenizer, prefill_tokens)
    short = prompt[:32]
    one = SamplingParams(temperature=0.0, max_tokens=1)
    many = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)

    def timed(llm, ids, params) -> float:
        t0 = time.perf_counter()
        llm.generate([ids], params, use_tqdm=False)
        return time.perf_counter() - t0

    for llm in llms.values():       # warm-up: first-call allocations
        timed(llm, short, one)
        timed(llm, prompt, one)
    runs = []
    for r in range(repeats):
        for name, llm in llms.items():
            pre = timed(llm, prompt, one)
            base = timed(llm, short, one)
            full = timed(llm, short, many)
            runs.append({"mode": name, "repeat": r, "prefill_tok_s": len(prompt) / pre,
                         "decode_tok_s": (decode_tokens - 1) / max(full - base, 1e-9)})
            print(f"speed {name} #{r}: prefill {runs[-1]['prefill_tok_s']:.0f} tok/s, "
                  f"decode {runs[-1]['decode_tok_s']:.1f} tok/s", flush=True)
    figures = {name: {k + "_median": statistics.median(x[k] for x in runs if x["mode"] == name)
                      for k in ("prefill_tok_s", "decode_tok_s")} for name in MODES}
    figures["prefill_tokens"], figures["decode_tokens"] = len(prompt), decode_tokens
    return figures, runs


def bench_agree(path: Path, n: int, max_tokens: int = 32) -> dict:
    from tokenyard.bench.serve_datasets import task_suite
    from tokenyard.engines import LLM, SamplingParams
    chats = [r.messages for r in task_suite(n, seed=0)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    replies = {}
    for name in ("int4_from_q4_1", "dequantised_fp32"):
        llm = LLM(str(path), kv_cache_memory=256 << 20, progress=False, **MODES[name])
        outs = llm.chat(chats, params, use_tqdm=False)
        replies[name] = [o.outputs[0].token_ids for o in outs]
        del llm
    exact, shares = 0, []
    for a, b in zip(replies["int4_from_q4_1"], replies["dequantised_fp32"]):
        exact += a == b
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), len(b), 1))
    return {"prompts": n, "max_tokens": max_tokens, "exact_match": exact, "exact_match_rate": exact / n,
            "mean_shared_prefix_share": statistics.fmean(shares)}


def bench_serve(requests: int = 32, concurrency: int = 4) -> dict:
    import yaml

    from tokenyard.bench.load_generator import LoadConfig, run_load
    from tokenyard.bench.serve_datasets import task_suite
    from tokenyard.bench.serve_launch import gateway_process
    from tokenyard.bench.serving_metrics import summarize
    src = yaml.safe_load((ROOT / "tokenyard" / "deploy" / "default.yaml").read_text())
    src["engines"] = {"smollm2-135m": src["engines"]["smollm2-135m"]}
    for key in ("router", "policy", "routing"):
        src.pop(key, None)
    src["redis_dir"] = str(ROOT / ".tokenyard" / "bench-smollm2-redis")
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "smollm2.yaml"
        cfg.write_text(yaml.safe_dump(src))
        with gateway_process(cfg, name="smollm2", model="smollm2-135m")() as ep:
            reqs = task_suite(requests, seed=1, max_tokens=48)
            res = run_load(reqs, LoadConfig(ep.base_url, api_key=ep.api_key, model="smollm2-135m",
                                            max_concurrency=concurrency, progress=False))
    s = summarize(res.records, res.duration_s, quantiles=(50, 90, 99)).to_dict()
    print(json.dumps({k: s[k] for k in ("completed", "failed", "output_throughput")}), flush=True)
    return {"requests": requests, "concurrency": concurrency, **s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["load", "speed", "agree", "serve"],
                    choices=["load", "speed", "agree", "serve"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=200)
    args = ap.parse_args()
    from tokenyard.engines.weights.gguf_models import smollm2_path
    path = smollm2_path()
    rec = RunRecorder("smollm2")
    figures, runs = {"model": path.name}, []
    if "load" in args.only:
        figures["load"], r = bench_load(path, args.repeats)
        runs += r
    if "speed" in args.only:
        figures["speed"], r = bench_speed(path, args.repeats)
        runs += r
    if "agree" in args.only:
        figures["agreement_int4_vs_fp32"] = bench_agree(path, args.prompts)
        print(figures["agreement_int4_vs_fp32"], flush=True)
    if "serve" in args.only:
        figures["serving_int4"] = bench_serve()
    rec.write(figures, runs)


if __name__ == "__main__":
    main()
