"""Micro-benchmarks behind the CPU engine's kernel choices, each against the alternative it replaced.

    .venv/bin/python -m tokenyard.bench.kernel_micro [--reps 30] [--rounds 5]

Shapes are W2's (8 heads, 2 KV heads, head_dim 64, fp32) and, for the int8 matmul, one FFN
projection of the quantisation benchmark's 200M Llama (5632 x 1024) at M = 32 rows.

- kv_gather: gathering 96 sequences' K (contexts 48-511 over scattered 16-token blocks) from a
  [kv_heads, slots, hd] cache: whole blocks by a dim-0 index_select over the 2-D view
  [kv_heads * blocks, 16 * hd] (the decode path of tokenyard/kernels/paged_attention_torch.py), token
  rows by a dim-0 index_select over [kv_heads * slots, hd] (its prefill path), and token rows
  along dim 1 (index_select(1, ...) and advanced indexing).
- decode_attention: 32 one-token queries over 512 keys with a mask: SDPA's fused CPU kernel with
  GQA vs two batched matmuls around a softmax (each KV head's 4 query heads as rows of one matmul).
- prefill_attention: one 512-token chunk attending causally to itself: 128-query tiles that each
  stop at their last visible key (the engine's path) vs one call over the whole [512, 512]
  score matrix with an explicit mask (bmm-softmax-bmm), and SDPA with is_causal for reference.
- int8_matmul_m32: torch's packed int8 CPU op vs dequantising to bf16 and one GEMM vs plain
  bf16 weights (tokenyard/engines/model/quantized_linear.py switches to dequantise-then-GEMM at measured
  thresholds: 96 rows for int4, 48 for int8).

Variants run interleaved in rounds, each timed as the fastest of `reps` calls per round; the
figure is the median over rounds. Raw output: bench/results/kernel_micro.json, or
kernel_micro_t<N>.json with --threads N.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tokenyard.bench.results_io import RunRecorder

HEADS, KV_HEADS, HD = 8, 2, 64


def best_ms(fn: Callable[[], object], reps: int) -> float:
    """Fastest of `reps` calls in ms (after one warm call). The minimum, as timeit does: on a
    machine shared with other work a call's time is its cost plus whatever preempted it, and
    only the minimum estimates the cost alone."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def kv_gather_cases(g: torch.Generator) -> dict[str, Callable[[], object]]:
    """96 sequences' K over scattered 16-token blocks (a paged cache after some churn)."""
    block, num_blocks = 16, 96 * 32
    slots = num_blocks * block
    cache = torch.randn(KV_HEADS, slots, HD, generator=g)
    lens = torch.randint(48, 512, (96,), generator=g)
    pool = torch.randperm(num_blocks, generator=g)
    tables, used = [], 0
    for n in lens.tolist():
        nb = -(-n // block)
        tables.append(pool[used:used + nb])
        used += nb
    blocks = torch.cat(tables)
    tokens = (blocks[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    block_rows = (torch.arange(KV_HEADS)[:, None] * num_blocks + blocks[None, :]).reshape(-1)
    token_rows = (torch.arange(KV_HEADS)[:, None] * slots + tokens[None, :]).reshape(-1)
    by_block = cache.view(-1, block * HD)
    by_token = cache.view(-1, HD)
    return {"whole blocks, index_select dim 0 on [kvh*blocks, 16*hd]": lambda: by_block.index_select(0, block_rows),
            "token rows, index_select dim 0 on [kvh*slots, hd]": lambda: by_token.index_select(0, token_rows),
            "token rows, cache.index_select(1, idx)": lambda: cache.index_select(1, tokens),
            "token rows, cache[:, idx]": lambda: cache[:, tokens]}


def decode_cases(g: torch.Generator) -> dict[str, Callable[[], object]]:
    b, keys = 32, 512
    q = torch.randn(b, HEADS, 1, HD, generator=g)
    k = torch.randn(b, KV_HEADS, keys, HD, generator=g)
    v = torch.randn(b, KV_HEADS, keys, HD, generator=g)
    lens = torch.randint(keys // 4, keys + 1, (b,), generator=g)
    mask = torch.zeros(b, 1, 1, keys).masked_fill_(torch.arange(keys)[None, None, None, :] >= lens[:, None, None, None],
                                                   float("-inf"))
    scale = HD ** -0.5

    group = HEADS // KV_HEADS
    qg = q.view(b, KV_HEADS, group, HD)               # a KV head's query heads as rows: no K/V copies

    def two_bmm():
        s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(mask)
        return torch.matmul(torch.softmax(s, dim=-1), v)

    return {"SDPA fused, GQA": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                      enable_gqa=True),
            "two batched matmuls": two_bmm}


def prefill_cases(g: torch.Generator) -> dict[str, Callable[[], object]]:
    n, group, tile = 512, HEADS // KV_HEADS, 128
    q = torch.randn(KV_HEADS, n, group, HD, generator=g)       # the engine's [kvh, n, group, hd] layout
    k = torch.randn(KV_HEADS, n, HD, generator=g)
    v = torch.randn(KV_HEADS, n, HD, generator=g)
    scale = HD ** -0.5
    pos = torch.arange(n)
    full_bias = torch.zeros(n, n).masked_fill_(pos[None, :] > pos[:, None], float("-inf"))
    biases = [full_bias[lo:lo + tile, :lo + tile].contiguous() for lo in range(0, n, tile)]

    def attend(lo: int, hi: int, k_hi: int, bias: torch.Tensor) -> torch.Tensor:
        rows = hi - lo
        qt = q[:, lo:hi].reshape(KV_HEADS, rows * group, HD)
        s = torch.bmm(qt, k[:, :k_hi].transpose(1, 2)).mul_(scale).view(KV_HEADS, rows, group, -1)
        p = torch.softmax(s.add_(bias[:, None, :]), dim=-1)
        return torch.bmm(p.view(KV_HEADS, rows * group, -1), v[:, :k_hi])

    def tiled():
        return [attend(lo, lo + tile, lo + tile, b) for lo, b in zip(range(0, n, tile), biases)]

    qh = q.permute(0, 2, 1, 3).reshape(1, HEADS, n, HD)
    kh, vh = k[None], v[None]
    return {"128-query tiles skipping hidden keys": tiled,
            "one [512, 512] masked bmm-softmax-bmm": lambda: attend(0, n, n, full_bias),
            "SDPA is_causal (reference)": lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                                                 enable_gqa=True)}


def int8_cases(g: torch.Generator) -> dict[str, Callable[[], object]]:
    m, n, k = 32, 5632, 1024
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g)
    scales = w.abs().amax(dim=1) / 127
    w8 = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    s16 = scales.to(torch.bfloat16)
    wbf = w.to(torch.bfloat16)
    cases = {"dequantise to bf16 + one GEMM": lambda: F.linear(x, w8.to(torch.bfloat16) * s16[:, None]),
             "bf16 weights, plain GEMM": lambda: F.linear(x, wbf)}
    op = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
    if op is not None:
        cases = {"packed int8 op (_weight_int8pack_mm)": lambda: op(x, w8, s16), **cases}
    return cases


SUITES = {"kv_gather": kv_gather_cases, "decode_attention": decode_cases, "prefill_attention": prefill_cases,
          "int8_matmul_m32": int8_cases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", choices=list(SUITES), nargs="+")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 keeps a loaded machine's "
                                                "preemptions from stalling every multi-threaded op at a barrier")
    ap.add_argument("--no-results", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rec = RunRecorder("kernel_micro" + (f"_t{args.threads}" if args.threads else ""))
    torch.manual_seed(0)
    figures, runs = {}, []
    with torch.inference_mode():
        for suite, build in SUITES.items():
            if args.only and suite not in args.only:
                continue
            cases = build(torch.Generator().manual_seed(0))
            per_round: dict[str, list[float]] = {name: [] for name in cases}
            for r in range(args.rounds):
                for name, fn in cases.items():      # interleaved: every variant sees the same load
                    per_round[name].append(round(best_ms(fn, args.reps), 4))
            med = {name: statistics.median(ts) for name, ts in per_round.items()}
            first = next(iter(med))
            figures[suite] = {"ms": med, "speedup_of_first_vs": {n: med[n] / med[first] for n in med if n != first}}
            runs.append({"suite": suite, "ms_per_round": per_round})
            print(f"{suite}:")
            for name, ms in med.items():
                print(f"  {name:45s} {ms:8.3f} ms  ({ms / med[first]:.2f}x of the first)")
    if not args.no_results:
        rec.write(figures, runs, reps=args.reps, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
