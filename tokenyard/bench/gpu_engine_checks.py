"""The engine-level rows of the GPU check: tensor parallelism 2 vs 1, and W2 throughput vs transformers.

Called by tokenyard/bench/gpu_check.py; imports engines/ and bench/ helpers only (never gateway/), so it
runs from PYTHONPATH on the GPU machine. The random checkpoint is written here with safetensors
(HF Llama names and config.json), so transformers is needed only for the W2 baseline; without
it that row is skipped with the reason.

tp2: the same prompts, greedy, through Engine(tensor_parallel_size=1) and (=2): the tokens must be
identical (fp32, so a near-tie cannot flip between the two summation orders). nccl on CUDA with
two or more GPUs; skipped with one. The dry run uses gloo on the CPU, as tests/engines/test_tensor_parallel.py.
w2: the engine's LLM.generate against transformers' generate in static batches of 32
(tokenyard/bench/w2_throughput.py's two runners), on the device, tokens/s of requested output.
"""
from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass(slots=True)
class Row:
    """One line of the check's summary table."""
    section: str
    name: str
    status: str        # "ok", "FAIL" or "skip"
    detail: str


def write_llama_checkpoint(out_dir: Path, shapes: dict, seed: int = 0, std: float = 0.05) -> Path:
    """A random-weight Llama checkpoint in HF layout (config.json + model.safetensors), fp32."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    h, ffn, layers = shapes["hidden_size"], shapes["intermediate_size"], shapes["num_hidden_layers"]
    heads, kv, vocab = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["vocab_size"]
    hd = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(h, generator=gen)

    t = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": norm(), "lm_head.weight": rand(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kv * hd, h),
              p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
              p + "mlp.gate_proj.weight": rand(ffn, h), p + "mlp.up_proj.weight": rand(ffn, h),
              p + "mlp.down_proj.weight": rand(h, ffn), p + "input_layernorm.weight": norm(),
              p + "post_attention_layernorm.weight": norm()}
    save_file({k: v.contiguous() for k, v in t.items()}, str(out_dir / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "torch_dtype": "float32",
              **{k: v for k, v in shapes.items() if k != "architectures"}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    return out_dir


def tp_row(model_dir: Path, device: str, prompts: list[list[int]], max_tokens: int) -> Row:
    from tokenyard.engines import Engine, SamplingParams

    world = 2
    if device == "cuda" and torch.cuda.device_count() < world:
        return Row("tensor parallel", "tp2 vs tp1 greedy (nccl)", "skip",
                   f"{torch.cuda.device_count()} GPU visible; tp2 needs {world}")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens, seconds = {}, {}
    for tp in (1, world):
        eng = Engine(model_dir, device=device, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=64 << 20,
                     progress=False, tp_timeout_s=120.0)
        try:
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            t0 = time.perf_counter()
            outs: dict[str, list[int]] = {}
            while eng.has_unfinished():
                for out in eng.step():
                    outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            seconds[tp] = time.perf_counter() - t0
            tokens[tp] = [outs.get(f"r{i}", []) for i in range(len(prompts))]
        finally:
            eng.close()
    same = tokens[1] == tokens[world]
    backend = "nccl" if device == "cuda" else "gloo"
    return Row("tensor parallel", f"tp{world} vs tp1 greedy ({backend})", "ok" if same else "FAIL",
               f"{len(prompts)} prompts x {max_tokens} tokens {'identical' if same else 'DIFFER'}; "
               f"tp1 {seconds[1]:.2f} s, tp{world} {seconds[world]:.2f} s")


def w2_row(model_dir: Path, device: str, num_requests: int, scale_output: float = 1.0) -> Row:
    if importlib.util.find_spec("transformers") is None:
        return Row("throughput", "W2 engine vs transformers", "skip",
                   "transformers is not installed here: no baseline to compare with")
    import transformers

    from tokenyard.bench.w2_throughput import run_ours
    from tokenyard.bench.workloads import w2
    from tokenyard.engines import LLM

    reqs = w2(num_requests, vocab_size=json.loads((model_dir / "config.json").read_text())["vocab_size"])
    if scale_output != 1.0:   # the dry run: the same workload shape, fewer tokens
        reqs = [replace(r, output_len=max(1, int(r.output_len * scale_output)),
                        prompt_token_ids=r.prompt_token_ids[:max(1, int(len(r.prompt_token_ids) * scale_output))])
                for r in reqs]
    useful = sum(r.output_len for r in reqs)
    llm = LLM(model_dir, device=device, dtype="float32", kv_cache_memory=1 << 30, max_num_seqs=128, progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    run_ours(llm, reqs[:2])                      # warm-up: one-time costs out of the timed runs
    ours = run_ours(llm, reqs)
    sync()
    theirs = _transformers_on(ref, reqs, device)
    ratio = theirs / ours
    return Row("throughput", "W2 engine vs transformers", "ok",
               f"{num_requests} requests: engine {useful / ours:.0f} tok/s, transformers static-32 "
               f"{useful / theirs:.0f} tok/s ({ratio:.2f}x)")


def _transformers_on(model, reqs, device: str) -> float:
    """bench/w2_throughput.run_transformers builds its batches on the CPU: move them for a GPU."""
    from tokenyard.bench import w2_throughput

    if device == "cpu":
        return w2_throughput.run_transformers(model, reqs)
    original = model.generate

    def on_device(input_ids, attention_mask, **kw):
        out = original(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kw)
        torch.cuda.synchronize()
        return out

    model.generate = on_device
    try:
        return w2_throughput.run_transformers(model, reqs)
    finally:
        del model.generate
