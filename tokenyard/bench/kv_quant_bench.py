"""KV-cache quantisation (EngineConfig.kv_cache_dtype): quality, capacity and speed on this CPU.

    .venv/bin/python -m tokenyard.bench.kv_quant_bench [--only nll capacity w2 decode4k] [--windows 8]

- nll: per-token NLL of held-out text through the paged cache, kv_cache_dtype int8 and fp8_e4m3
  vs auto (same fp32 weights), on SmolLM2-135M-Instruct (its GGUF dequantised to fp32, loaded as
  tokenyard/bench/smollm2_bench.py does) over windows of this repository's docs/*.md (written after the
  model was trained), and on demo-large over task-suite test conversations (the reference
  answers' tokens, after the prompt; the demo models were trained on replies only). Also the
  scale granularity the engine does not use, to justify the one it does: K/V are
  fake-quantised before an auto-dtype cache (codes -> values) with one scale per (token, kv
  head) (what the engine stores; a check: it must match the int8 engine) or per (16-token block,
  kv head), the block's scale taken from all of its tokens (the best a per-block scheme could do,
  as if it re-quantised the block whenever a larger value arrived).
- capacity: the W2 model at a fixed kv_cache_memory, 128 requests of 256 prompt + 128 output
  tokens arriving at once, `--capacity-steps` steps: blocks, how many whole 384-token sequences
  fit, the most sequences running in one step (admission reserves only the prompt's blocks, so
  this is higher), preemptions; auto fp32, auto bf16 (a bf16 model, the GPU default), int8,
  fp8_e4m3.
- w2: W2 (tokenyard/bench/w2_throughput.py's workload and model, fewer requests) at that KV memory: output
  tok/s per kv_cache_dtype, runs interleaved, median.
- decode4k: the W2 architecture with 4096 positions: median decode step time of 1 and 4 sequences
  at a 4k context, per kv_cache_dtype, the dtypes' steps interleaved.

Single-threaded by default (torch.set_num_threads(--threads), 1 unless given; OMP_NUM_THREADS
alone does not change it) on a shared 2-core VM: the load average is recorded.
Writes bench/results/kv_quant.json (bench/results_io.py).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import time
from pathlib import Path

import torch

from .results_io import RunRecorder

ROOT = Path(__file__).resolve().parents[2]
KV_DTYPES = ("auto", "int8", "fp8_e4m3")


# -- nll -------------------------------------------------------------------------------------

def window_nll(engine, ids: list[int], chunk: int = 128) -> torch.Tensor:
    """NLL of ids[1:] given the prefix, computed through the engine's paged KV cache in prefill
    chunks of `chunk` tokens (each chunk reads the earlier ones back from the cache)."""
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.core.sequence import Sequence
    from tokenyard.engines.model.attention import AttentionMetadata

    seq = Sequence("nll-probe", list(ids), SamplingParams(), 0, 0, 0, frozenset())
    blocks, bs = engine.blocks, engine.blocks.block_size
    rows = []
    try:
        blocks.grow(seq.block_table, len(ids))
        for start in range(0, len(ids), chunk):
            end = min(len(ids), start + chunk)
            slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            meta = AttentionMetadata.build(slots, [end - start], [end], [seq.block_table], bs,
                                           engine.model_config.sliding_window, engine.device)
            rows.append(engine.model(torch.tensor(ids[start:end]), torch.arange(start, end), meta,
                                     engine.runner.kv_caches, torch.arange(end - start)))
    finally:
        blocks.free(seq)
    logits = torch.cat(rows)[:-1].float()
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")


def _fake_quant(x: torch.Tensor, dtype: torch.dtype, per_block: int | None) -> torch.Tensor:
    """x [T, kv_heads, head_dim] quantised and dequantised: one scale per (token, head), or per
    (per_block tokens, head) with the block's scale over all of its tokens (chunk starts are
    block-aligned here, so the chunk's blocks are the cache's blocks)."""
    from tokenyard.kernels.kv_quant import dequantize, quantize
    if per_block is None:
        codes, scale = quantize(x, dtype)
        return dequantize(codes, scale, x.dtype)
    t, h, d = x.shape
    pad = -t % per_block
    xb = torch.cat([x, x.new_zeros(pad, h, d)]).view(-1, per_block, h, d).transpose(1, 2)   # [nb, h, bs, d]
    flat = xb.reshape(xb.shape[0], h, per_block * d)                                          # a block = one row
    codes, scale = quantize(flat, dtype)
    back = dequantize(codes, scale, x.dtype).view(-1, h, per_block, d).transpose(1, 2).reshape(-1, h, d)
    return back[:t]


@contextlib.contextmanager
def fake_quantised_kv(dtype: torch.dtype, per_block: int | None):
    """Every layer's new K/V are fake-quantised before the (unquantised) cache write."""
    from tokenyard.engines.model import model as model_module
    real = model_module.attend

    def attend(q, k, v, k_cache, v_cache, meta, scale):
        return real(q, _fake_quant(k, dtype, per_block), _fake_quant(v, dtype, per_block), k_cache, v_cache,
                    meta, scale)

    model_module.attend = attend
    try:
        yield
    finally:
        model_module.attend = real


def _nll_variants(model: str | Path, windows: list[tuple[list[int], int]], engine_kw: dict) -> dict:
    """Mean per-token NLL for each variant, and its mean difference to auto (paired by token).
    windows: (token ids, index of the first token scored)."""
    from tokenyard.engines import LLM
    per: dict[str, torch.Tensor] = {}
    llms = {kv: LLM(str(model), kv_cache_dtype=kv, progress=False, enable_prefix_caching=False, **engine_kw)
            for kv in KV_DTYPES}
    for kv, llm in llms.items():
        per[kv] = torch.cat([window_nll(llm.engine, w)[first - 1 if first else 0:] for w, first in windows])
    for name, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        for label, per_block in (("per_token_fake", None), ("per_block16_fake", 16)):
            with fake_quantised_kv(dtype, per_block):
                per[f"{name}_{label}"] = torch.cat([window_nll(llms["auto"].engine, w)[first - 1 if first else 0:]
                                                    for w, first in windows])
    base = per["auto"]
    out = {"tokens": int(base.numel()), "nll_auto": float(base.mean())}
    for k, v in per.items():
        if k == "auto":
            continue
        out[k] = {"nll": float(v.mean()), "delta_nats_per_token": float((v - base).mean()),
                  "mean_abs_delta": float((v - base).abs().mean())}
    return out


def _docs_windows(tokenizer, size: int, count: int) -> tuple[list[tuple[list[int], int]], str]:
    text = "\n\n".join((ROOT / "docs" / name).read_text() for name in ("architecture.md", "production.md",
                                                                          "kubernetes.md"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [(ids[i * size:(i + 1) * size], 0) for i in range(min(count, len(ids) // size))], \
        hashlib.sha256(text.encode()).hexdigest()[:16]


def _demo_conversations(tokenizer, count: int) -> list[tuple[list[int], int]]:
    """Test-split conversations with their reference answers; only the answer is scored (the demo
    models were trained on replies only, so their prompt tokens are not text they predict)."""
    from tokenyard.demo import task_suite
    from tokenyard.engines.text.chat_template import apply_chat_template
    out = []
    for it in task_suite.generate_items("test", count, seed=7):
        prompt = apply_chat_template(tokenizer, list(it.messages), add_generation_prompt=True, tokenize=True)
        full = apply_chat_template(tokenizer, [*it.messages, {"role": "assistant", "content": it.answer}],
                                   add_generation_prompt=False, tokenize=True)
        assert full[:len(prompt)] == prompt
        out.append((full, len(prompt)))
    return out


def bench_nll(windows: int) -> dict:
    from tokenyard.engines import LLM
    from tokenyard.engines.weights.gguf_models import smollm2_path
    path = smollm2_path()
    tok = LLM(str(path), kv_cache_memory=8 << 20, progress=False, dtype="float32").tokenizer
    docs, digest = _docs_windows(tok, 512, windows)
    res = {"smollm2_135m_fp32": {"text": f"docs/*.md (sha256 {digest}), {len(docs)} windows of 512 tokens",
                                 **_nll_variants(path, docs, dict(dtype="float32", kv_cache_memory=64 << 20))}}
    print("smollm2", res["smollm2_135m_fp32"], flush=True)
    demo = ROOT / "models" / "demo-large"
    dtok = LLM(str(demo), kv_cache_memory=8 << 20, progress=False).tokenizer
    dw = _demo_conversations(dtok, 32 * windows)
    res["demo_large"] = {"text": f"{len(dw)} task-suite test conversations, reference answer tokens scored",
                         **_nll_variants(demo, dw, dict(kv_cache_memory=64 << 20))}
    print("demo-large", res["demo_large"], flush=True)
    return res


# -- capacity, W2 throughput, decode at 4k ---------------------------------------------------

CAPACITY_CASES = {"auto_fp32": dict(dtype="float32", kv_cache_dtype="auto"),
                  "auto_bf16": dict(dtype="bfloat16", kv_cache_dtype="auto"),
                  "int8": dict(dtype="float32", kv_cache_dtype="int8"),
                  "fp8_e4m3": dict(dtype="float32", kv_cache_dtype="fp8_e4m3")}


def _w2_model() -> Path:
    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    from tokenyard.bench.workloads import W2_MODEL
    return build_random_checkpoint(ROOT / "bench" / "out" / "w2-llama-30m", "llama", seed=0, std=0.05, **W2_MODEL)


def bench_capacity(kv_memory: int, steps: int) -> dict:
    from tokenyard.engines import LLM, SamplingParams
    model = _w2_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8192, (256,), generator=g).tolist() for _ in range(128)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    out = {"kv_cache_memory": kv_memory, "requests": "128 x (256 prompt + 128 output)", "steps": steps}
    for name, kw in CAPACITY_CASES.items():
        eng = LLM(str(model), kv_cache_memory=kv_memory, max_num_seqs=256, max_num_batched_tokens=4096,
                  enable_prefix_caching=False, progress=False, **kw).engine
        for i, p in enumerate(prompts):
            eng.add_request(f"c{i}", p, params)
        peak, running = 0, []
        for _ in range(steps):
            eng.step()
            running.append(eng.stats().num_running)
            peak = max(peak, running[-1])
        st = eng.stats()
        per_seq = -(-384 // st.block_size)
        out[name] = {"blocks": st.num_total_blocks, "bytes_per_block": st.kv_bytes_per_block,
                     "sequences_that_fit": st.num_total_blocks // per_seq, "peak_running": peak,
                     "running_last_step": running[-1], "preemptions": st.num_preemptions}
        print("capacity", name, out[name], flush=True)
        del eng
    for name in ("int8", "fp8_e4m3"):
        out[f"{name}_vs_bf16_peak_running"] = out[name]["peak_running"] / out["auto_bf16"]["peak_running"]
        out[f"{name}_vs_fp32_peak_running"] = out[name]["peak_running"] / out["auto_fp32"]["peak_running"]
    return out


def bench_w2(kv_memory: int, requests: int, runs: int) -> tuple[dict, list]:
    from tokenyard.bench.w2_throughput import run_ours
    from tokenyard.bench.workloads import W2_MODEL, w2
    from tokenyard.engines import LLM
    model = _w2_model()
    reqs = w2(requests, vocab_size=W2_MODEL["vocab_size"])
    useful = sum(r.output_len for r in reqs)
    llms = {kv: LLM(str(model), dtype="float32", kv_cache_dtype=kv, kv_cache_memory=kv_memory, max_num_seqs=128,
                    max_num_batched_tokens=2048, enable_prefix_caching=False, progress=False) for kv in KV_DTYPES}
    for llm in llms.values():
        run_ours(llm, reqs[:4])   # warm-up
    runs_out = []
    for r in range(runs):
        for kv, llm in llms.items():
            pre = llm.engine.stats().num_preemptions
            secs = run_ours(llm, reqs)
            runs_out.append({"section": "w2", "kv_cache_dtype": kv, "run": r, "seconds": secs,
                             "tok_s": useful / secs, "preemptions": llm.engine.stats().num_preemptions - pre})
            print("w2", runs_out[-1], flush=True)
    fig = {"kv_cache_memory": kv_memory, "requests": requests, "useful_output_tokens": useful}
    for kv in KV_DTYPES:
        mine = [x for x in runs_out if x["kv_cache_dtype"] == kv]
        fig[kv] = {"tok_s_median": statistics.median(x["tok_s"] for x in mine),
                   "preemptions_per_run": statistics.median(x["preemptions"] for x in mine),
                   "blocks": llms[kv].engine.stats().num_total_blocks}
    for kv in ("int8", "fp8_e4m3"):
        fig[f"{kv}_vs_auto_throughput"] = fig[kv]["tok_s_median"] / fig["auto"]["tok_s_median"]
    return fig, runs_out


def bench_decode4k(context: int, steps: int, batches: tuple[int, ...], cpu_compile: str = "off",
                   kv_dtypes: tuple[str, ...] = KV_DTYPES) -> tuple[dict, list]:
    from tokenyard.bench.random_checkpoint import build_random_checkpoint
    from tokenyard.bench.workloads import W2_MODEL
    from tokenyard.engines import LLM, SamplingParams
    spec = {**W2_MODEL, "max_position_embeddings": context + 256}
    model = build_random_checkpoint(
        ROOT / "bench" / "out" / f"w2-llama-30m-{spec['max_position_embeddings']}",
        "llama",
        seed=0,
        std=0.05,
        **spec,
    )
    g = torch.Generator().manual_seed(1)
    runs, fig = [], {"context": context, "steps": steps, "cpu_compile": cpu_compile}
    # A compiled graph covers up to max_num_seqs sequences: keep it to the batches measured.
    compiled_kw = {"max_num_seqs": max(batches)} if cpu_compile == "on" else {}
    for batch in batches:
        prompts = [torch.randint(3, 8192, (context,), generator=g).tolist() for _ in range(batch)]
        engines = {}
        for kv in kv_dtypes:
            eng = LLM(str(model), dtype="float32", kv_cache_dtype=kv, kv_cache_memory=(64 << 20) * batch,
                      max_num_batched_tokens=1024, enable_prefix_caching=False, progress=False,
                      cpu_compile=cpu_compile, **compiled_kw).engine
            params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
            for i, p in enumerate(prompts):
                eng.add_request(f"d{i}", p, params)
            while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) \
                    or eng.scheduler.waiting or eng._inbox.num_new:
                eng.step()
            eng.step()   # the first pure-decode step
            engines[kv] = eng
        times: dict[str, list[float]] = {kv: [] for kv in kv_dtypes}
        for _ in range(steps):   # interleaved, so a change of machine load hits every dtype alike
            for kv, eng in engines.items():
                t0 = time.perf_counter()
                eng.step()
                times[kv].append(time.perf_counter() - t0)
        for kv in kv_dtypes:
            ms = 1e3 * statistics.median(times[kv])
            runs.append({"section": "decode4k", "batch": batch, "kv_cache_dtype": kv,
                         "step_ms": [1e3 * t for t in times[kv]]})
            fig[f"batch{batch}_{kv}_step_ms_median"] = ms
            print(f"decode4k batch {batch} {kv}: {ms:.1f} ms/step", flush=True)
        del engines
    return fig, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=["nll", "capacity", "w2", "decode4k"],
                    choices=["nll", "capacity", "w2", "decode4k"])
    ap.add_argument("--windows", type=int, default=8, help="NLL windows per model")
    ap.add_argument("--kv-memory-mib", type=int, default=32, help="fixed KV memory of capacity and w2")
    ap.add_argument("--capacity-steps", type=int, default=24)
    ap.add_argument("--w2-requests", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode-steps", type=int, default=12)
    ap.add_argument(
        "--cpu-compile",
        default="off",
        choices=["off", "on"],
        help="decode4k: run the decode steps through the compiled CPU graph (tokenyard/engines/model/compiled_decoder.py)",
    )
    ap.add_argument("--kv-dtypes", nargs="*", default=list(KV_DTYPES), choices=list(KV_DTYPES),
                    help="decode4k: the kv_cache_dtype values to compare")
    ap.add_argument("--name", default="kv_quant", help="results file name under bench/results/")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rec = RunRecorder(args.name)
    figures, runs = {"threads": args.threads}, []
    if "nll" in args.only:
        figures["nll"] = bench_nll(args.windows)
    if "capacity" in args.only:
        figures["capacity"] = bench_capacity(args.kv_memory_mib << 20, args.capacity_steps)
    if "w2" in args.only:
        figures["w2"], r = bench_w2(args.kv_memory_mib << 20, args.w2_requests, args.runs)
        runs += r
    if "decode4k" in args.only:
        figures["decode4k"], r = bench_decode4k(args.context, args.decode_steps, (1, 4), args.cpu_compile,
                                                tuple(args.kv_dtypes))
        runs += r
    rec.write(figures, runs)


if __name__ == "__main__":
    main()
