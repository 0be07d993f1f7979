"""SmolLM2-135M-Instruct (Q4_1 GGUF): int4 kept as stored vs dequantised fp32, on this CPU.

Measures, for each way of loading the same file through the engine (`LLM`):
- load time: `LLM(...)` construction, model and tokenizer (the GGUF reader is cached per process,
  so a first untimed load parses the metadata and every timed load starts from the same state);
- batch-1 greedy decode tok/s: `--tokens` new tokens (ignore_eos) after a short chat prompt,
  decode time = total - a 1-token request's time, median of `--repeats`.
And, once: the largest error of the CPU packed int4 op's weights against gguf's dequantisation
over every Q4_1 projection (it keeps scale and zero' = min + 8 * scale in bf16).

    .venv/bin/python -m tokenyard.bench.gguf_quant_bench [--tokens 64] [--repeats 3]

Writes bench/results/gguf_quant.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.formats import gguf_reader as gr
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.weights.gguf_models import smollm2_path

from .results_io import RunRecorder

MODES = {"dequantised_fp32": dict(quantization="none", dtype="float32"),
         "int4_from_q4_1": dict(quantization="int4", quant_group_size=32, dtype="float32")}
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def _load(path, kw: dict) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(path, kv_cache_memory=64 << 20, max_num_batched_tokens=256, progress=False,
              enable_prefix_caching=False, **kw)  # both requests of _decode pay the same prefill
    return llm, time.perf_counter() - t0


def _decode(llm: LLM, tokens: int) -> dict:
    """Decode rate = (new tokens - 1) / (time of the full request - time of a 1-token request):
    the 1-token request pays the same prefill, so the difference is the decode steps."""
    t0 = time.perf_counter()
    llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)[0]
    total = time.perf_counter() - t0
    n = len(out.outputs[0].token_ids)
    return {"new_tokens": n, "total_s": total, "prefill_s": prefill,
            "decode_tok_s": (n - 1) / max(total - prefill, 1e-9)}


def cpu_weight_error(path) -> dict:
    """max |w seen by the CPU packed op - gguf's dequantisation| over every Q4_1 tensor."""
    worst, worst_rel, n = 0.0, 0.0, 0
    for t in gr.open_gguf(path).tensors:
        if t.tensor_type.name != "Q4_1":
            continue
        layout = gr.int4_blocks(t)
        want = gr.dequantize(t)
        lin = QuantLinear(layout, backend="cpu")
        with torch.no_grad():
            seen = lin(torch.eye(want.shape[1])).t()
        err = float((seen - want).abs().max())
        worst, worst_rel = max(worst, err), max(worst_rel, err / float(want.abs().max()))
        n += 1
    return {"tensors": n, "max_abs_error": worst, "max_error_over_tensor_max_abs_w": worst_rel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rec = RunRecorder("gguf_quant")
    path = smollm2_path()
    gr.open_gguf(path)  # parse the metadata once, outside every timing
    runs, figures = [], {}
    for name, kw in MODES.items():
        loads, decodes = [], []
        for r in range(args.repeats):
            llm, load_s = _load(path, kw)
            loads.append(load_s)
            _decode(llm, 8)  # warm-up: first-call allocations
            d = _decode(llm, args.tokens)
            decodes.append(d)
            runs.append({"mode": name, "repeat": r, "load_s": load_s, **d})
            print(f"{name} #{r}: load {load_s:.2f} s, decode {d['decode_tok_s']:.1f} tok/s", flush=True)
            del llm
        figures[name] = {"load_s_median": statistics.median(loads),
                         "decode_tok_s_median": statistics.median(d["decode_tok_s"] for d in decodes)}
    figures["decode_speedup_int4_over_fp32"] = (figures["int4_from_q4_1"]["decode_tok_s_median"]
                                                / figures["dequantised_fp32"]["decode_tok_s_median"])
    figures["load_speedup_int4_over_fp32"] = (figures["dequantised_fp32"]["load_s_median"]
                                              / figures["int4_from_q4_1"]["load_s_median"])
    figures["cpu_int4_weight_error_vs_gguf"] = cpu_weight_error(path)
    print(figures)
    rec.write(figures, runs, model=str(path.name), tokens=args.tokens, repeats=args.repeats,
              torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
