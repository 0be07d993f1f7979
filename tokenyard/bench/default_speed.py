"""What `LLM(path)` gives with its defaults on SmolLM2-135M-Instruct's Q4_1 GGUF (issue 49.1), against
the previous defaults, in one process, interleaved rounds.

- defaults: `LLM(path)` as a user writes it (quantization auto: the Q4_1 blocks as int4 in groups of
  32; dtype auto: fp32 on a CPU, so batch-1 decode runs in the C decode step);
- before (quantization none): what `LLM(path)` did until 2026-12-05: the file dequantised to fp32;
- before (int4, bf16): what naming `quantization="int4"` gave with dtype auto (bf16 activations on a
  CPU, which skip the C decode step).
Per round and engine: batch-1 decode tok/s (a 64-token greedy reply after a short chat prompt, EOS
held back) and prefill time of a 512-token prompt (max_tokens 1); the figure is the median of rounds.

    .venv/bin/python -m tokenyard.bench.default_speed [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    import torch

    from tokenyard.bench.results_io import RunRecorder
    from tokenyard.engines import LLM, SamplingParams
    from tokenyard.engines.weights.gguf_models import smollm2_path
    rec = RunRecorder("default_speed")
    path = smollm2_path()
    setups = {"defaults": {}, "before_none_fp32": {"quantization": "none"},
              "before_int4_bf16": {"quantization": "int4", "quant_group_size": 32, "dtype": "bfloat16"}}
    llms: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    for name, opts in setups.items():
        t0 = time.perf_counter()
        llms[name] = LLM(path, kv_cache_memory=64 << 20, progress=False, **opts)
        load_s[name] = round(time.perf_counter() - t0, 2)
    eos = sorted(llms["defaults"].engine.eos_token_ids)
    decode = SamplingParams(max_tokens=args.tokens, temperature=0.0, logit_bias={t: -100.0 for t in eos})
    chat = [[{"role": "user", "content": "Write a short story about a lighthouse keeper."}]]
    rng = __import__("random").Random(0)
    per: dict[str, dict[str, list[float]]] = {n: {"decode_tok_s": [], "prefill512_ms": []} for n in setups}
    names = list(setups)
    for r in range(args.rounds + 1):
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm = llms[name]
            t0 = time.perf_counter()
            llm.chat(chat, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            out = llm.chat(chat, decode, use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            n = len(out.outputs[0].token_ids)
            # decode rate: the tokens after the first over the time past a one-token request's
            rate = (n - 1) / max(1e-9, wall - one)
            t0 = time.perf_counter()
            # a new 512-token prompt each time: the prefix cache must not serve it
            prompt = [[rng.randrange(100, 40000) for _ in range(512)]]
            llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            prefill = time.perf_counter() - t0
            if r:                       # round 0 warms every path up
                per[name]["decode_tok_s"].append(round(rate, 1))
                per[name]["prefill512_ms"].append(round(prefill * 1000, 1))
    figures: dict[str, Any] = {"model": path.name, "threads": torch.get_num_threads(), "rounds": args.rounds,
                               "decode_tokens": args.tokens}
    for name in setups:
        figures[f"{name}_decode_tok_s"] = statistics.median(per[name]["decode_tok_s"])
        figures[f"{name}_prefill512_ms"] = statistics.median(per[name]["prefill512_ms"])
        figures[f"{name}_load_s"] = load_s[name]
        figures[f"{name}_config"] = {"quantization": llms[name].engine.config.quantization,
                                     "dtype": str(llms[name].engine.dtype)}
    figures["defaults_vs_before_decode"] = round(figures["defaults_decode_tok_s"] / figures["before_none_fp32_decode_tok_s"], 2)
    print(figures)
    rec.write(figures, [per])


if __name__ == "__main__":
    main()
