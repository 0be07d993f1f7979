"""End-to-end decode on a GPU: a random 1B-parameter Llama in bf16, eager vs CUDA graphs.

    PYTHONPATH=. python -m tokenyard.bench.gpu_decode [--batches 1 64] [--context 512] [--steps 64]

Called by tokenyard/bench/gpu_check.py after the kernel checks; runs alone too. Imports engines/ and
kernels/ only (no transformers, no checkpoint on disk: the model is built with random weights
in place), so it runs from a plain checkout with the GPU machine's own torch and triton.

Each step is what the engine's runner does for a pure-decode batch: build the inputs on the
host, run the forward (eager: AttentionMetadata.build + model; graphs: CudaGraphDecoder.run,
which copies into static buffers and replays) and take the greedy argmax. The floor is the
bytes one step must read (all weights once, plus every sequence's K/V) over the measured device
copy bandwidth. Before timing, graph and eager logits are compared on the same inputs, and the
greedy tokens of every timed step must be the same on both paths.

The dry run (`run(..., dry_run=True)`, CPU, TRITON_INTERPRET=1) has no GPU to capture on: its
graph rows, named UNCAPTURED, run CudaGraphDecoder's static-buffer, padded path eagerly.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

LLAMA_1B = {  # ~1.1B parameters: Llama-3.2-1B-like shapes with a 32k vocabulary
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 4096, "rope_theta": 500000.0,
}


@dataclass(slots=True)
class DecodeResult:
    batch: int
    mode: str
    ms_per_step: float
    tokens_per_s: float
    floor_ms: float
    max_logit_diff: float = float("nan")   # |graph path - eager| logits on the same inputs
    same_tokens: bool = True               # both paths' greedy tokens equal on every timed step


CAPTURED = "cuda graphs"
UNCAPTURED = "graph path, uncaptured"


TINY = {**LLAMA_1B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # for the CPU dry run in the tests


def build_model(dtype: torch.dtype, device: torch.device, max_positions: int, shapes: dict):
    from tokenyard.engines.model.model import CausalLM
    from tokenyard.engines.model.model_config import ModelConfig

    cfg = ModelConfig.from_dict(shapes)
    torch.manual_seed(0)
    with device:
        model = CausalLM(cfg, max_positions)
    for p in model.parameters():  # small weights keep bf16 activations finite through 16 layers
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    model.to(dtype).eval()
    return model, cfg


def run(batches: list[int], context: int, steps: int, bandwidth_bytes_per_ms: float,
        dry_run: bool = False) -> list[DecodeResult]:
    """dry_run: a tiny fp32 model on the CPU with the graph path run eagerly (needs
    TRITON_INTERPRET=1); checks this script's plumbing, not speed."""
    from tokenyard.engines.model.attention import AttentionMetadata
    from tokenyard.engines.model.cuda_graph_runner import CudaGraphDecoder
    from tokenyard.engines.model.kv_cache import allocate_kv_cache

    dev = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16
    sync = (lambda: None) if dry_run else torch.cuda.synchronize
    bs = 16
    max_len = context + steps + 16
    model, cfg = build_model(dtype, dev, max_len, TINY if dry_run else LLAMA_1B)
    width = -(-max_len // bs)
    max_b = max(batches)
    kv = allocate_kv_cache(cfg, max_b * width + 1, bs, dtype, dev)
    for k, v in kv:
        k.normal_()
        v.normal_()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    graphs = CudaGraphDecoder(model, kv, bs, width, max_b, dev, capture=not dry_run)
    results: list[DecodeResult] = []
    for b in batches:
        tables = [list(range(i * width, (i + 1) * width)) for i in range(b)]

        def inputs(step: int):
            pos = context + step
            ids = [(7 * i + step) % cfg.vocab_size for i in range(b)]
            slots = [t[pos // bs] * bs + pos % bs for t in tables]
            return ids, [pos] * b, slots, [pos + 1] * b

        def eager(step: int) -> torch.Tensor:
            ids, pos, slots, lens = inputs(step)
            meta = AttentionMetadata.build(slots, [1] * b, lens, tables, bs, None, dev, "triton")
            return model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), meta, kv,
                         torch.arange(b, device=dev))

        def graphed(step: int) -> torch.Tensor:
            ids, pos, slots, lens = inputs(step)
            return graphs.run(ids, pos, slots, lens, tables)

        diff = (eager(0) - graphed(0)).abs().max().item()
        floor = (weight_bytes + b * (context + steps // 2) * kv_bytes_per_token) / bandwidth_bytes_per_ms
        tokens: dict[str, list] = {}
        for mode, fn in (("eager", eager), (UNCAPTURED if dry_run else CAPTURED, graphed)):
            for s in range(3):
                fn(s).argmax(-1).tolist()
            sync()
            t0 = time.perf_counter()
            # the host needs the tokens every step, as the engine does
            tokens[mode] = [fn(s).argmax(-1).tolist() for s in range(steps)]
            ms = (time.perf_counter() - t0) * 1e3 / steps
            results.append(DecodeResult(b, mode, ms, b * 1e3 / ms, floor, diff))
        same = len({str(t) for t in tokens.values()}) == 1
        for r in results[-2:]:
            r.same_tokens = same
    return results


def print_table(results: list[DecodeResult]) -> None:
    print(f"\n{'decode (random Llama)':26} {'batch':>5} {'ms/step':>8} {'tok/s':>9} {'floor ms':>9} "
          f"{'% floor':>8} {'|graph-eager|':>13} {'same tokens':>11}")
    for r in results:
        print(f"{r.mode:26} {r.batch:5d} {r.ms_per_step:8.3f} {r.tokens_per_s:9.0f} {r.floor_ms:9.3f} "
              f"{100 * r.floor_ms / r.ms_per_step:7.0f}% {r.max_logit_diff:13.2e} {str(r.same_tokens):>11}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode: needs a CUDA device")
        return 2
    from tokenyard.bench.gpu_timing import copy_bandwidth
    print_table(run(args.batches, args.context, args.steps, copy_bandwidth("cuda")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
