"""GPU check for the Triton kernels: correctness at GPU sizes, then timings against floors.

    PYTHONPATH=. python -m tokenyard.bench.gpu_check [--out gpu_check.json] [--quick]
    tokenyard/bench/gpu_check.sh [--out ...]          (the same, from any directory)

Runs from a plain checkout with the machine's own torch and triton; imports only kernels/.
(a) Every kernel against its torch reference (fp32 reference on the same rounded inputs):
    write_kv exactly; attention and quantised matmuls in fp32, fp16 and bf16 within
    max|out - ref| <= tol * max|ref| (fp32 2e-5, fp16 5e-3, bf16 3e-2).
(b) Median time over CUDA-event timed runs (L2 flushed before each) against the memory floor,
    bytes moved / copy bandwidth measured here with a large device-to-device copy; attention
    also against torch SDPA over already-gathered contiguous KV, quantised matmuls against a
    dense fp16/bf16 cuBLAS matmul. A table is printed and everything is written as JSON.
(c) End-to-end decode tokens/s of a random 1.1B Llama in bf16 at batch 1 and 64, eager vs
    CUDA graphs (same greedy tokens), against the weight + KV read floor (tokenyard/bench/gpu_decode.py).
(d) Tensor parallelism 2 over nccl (when 2 GPUs exist): the same greedy tokens as 1 GPU; and the
    W2 throughput of the engine vs transformers on the GPU (skipped, with the reason, where
    transformers is not installed) (tokenyard/bench/gpu_engine_checks.py).
Ends with one summary table: a row per check, ok / FAIL / skip and the figure behind it.

    tokenyard/bench/gpu_check.sh --dry-run    the same code on the CPU at toy sizes (kernels interpreted,
                                    gloo for tp2); tests/bench/test_gpu_check.py runs it in `make test`
                                    so the script cannot rot between GPU sessions.
Exit status: 0 all correct, 1 a failure, 2 no CUDA device (without --dry-run).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tokenyard.bench import gpu_timing
from tokenyard.bench.gpu_check_summary import Check, Timing

TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE = "cuda"
TIMING_DTYPE = torch.bfloat16
DECODE = dict(batches=[1, 64], context=512, steps=64)
TP = dict(prompts=8, max_tokens=32)
W2 = dict(requests=96, scale_output=1.0)
# Sizes, module-level so a dry run can shrink them. Llama-3-8B-like heads: 8 kv heads, head_dim 128.
WRITE_KV_CHECK = dict(tokens=4099, kv_heads=8, head_dim=128, slots=1 << 15)
QUANT_CHECK = dict(n=4096, k=4096, ms=(1, 16, 100, 1000))
DECODE_TIMINGS = ((64, 4096), (8, 16384), (256, 1024))          # (batch, context)
PREFILL_TIMINGS = ((4, 2048), (1, 8192))                         # (sequences, length)
VERIFY_TIMING = (32, 5, 4096)                                    # (batch, rows, context)
WRITE_KV_TIMING = dict(tokens=8192, slots=1 << 17)
QUANT_TIMINGS = dict(shapes=((4096, 4096), (14336, 4096), (4096, 14336)), ms=(1, 16, 64, 256))
COPY_ELEMS = 1 << 30                                             # fp16: 2 GiB


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if out.isnan().any():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------------------------
# Random paged batches


@dataclass(slots=True)
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    tables: list[list[int]]
    query_lens: list[int]
    lens: list[int]
    block_size: int
    max_query_len: int


def make_batch(query_lens: list[int], seq_lens: list[int], kv_heads: int, group: int, head_dim: int,
               dtype: torch.dtype, block_size: int = 16, seed: int = 0) -> Batch:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 8
    order = torch.randperm(num_blocks, device=DEVICE, generator=gen).tolist()  # scattered blocks
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n])
        used += n
    shape = (kv_heads, num_blocks * block_size, head_dim)
    k_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    v_cache = torch.randn(shape, device=DEVICE, dtype=dtype, generator=gen)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, device=DEVICE, dtype=dtype, generator=gen)
    bt = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    return Batch(q, k_cache, v_cache, qsl.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                 bt.to(DEVICE), tables, query_lens, seq_lens, block_size, max(query_lens))


def run_triton_attention(b: Batch, window: int | None = None, num_splits: int | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    from tokenyard.kernels.paged_attention_triton import paged_attention
    return paged_attention(b.q, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                           b.block_size, b.q.shape[-1] ** -0.5, sliding_window=window,
                           max_query_len=b.max_query_len, num_splits=num_splits, out=out)


def reference_attention(b: Batch, window: int | None = None) -> torch.Tensor:
    from tokenyard.kernels.paged_attention_torch import TorchAttentionPlan, paged_attention
    plan = TorchAttentionPlan.build(b.query_lens, b.lens, b.tables, b.block_size, window, device=DEVICE)
    return paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(), plan, b.q.shape[-1] ** -0.5)


# ----------------------------------------------------------------------------------------------
# (a) correctness

def check_write_kv(checks: list[Check]) -> None:
    from tokenyard.kernels import paged_attention_torch as ref
    from tokenyard.kernels import paged_attention_triton as tri
    for dtype in (torch.float16, torch.bfloat16):
        tokens, kvh, hd, slots = (WRITE_KV_CHECK[k] for k in ("tokens", "kv_heads", "head_dim", "slots"))
        k = torch.randn(tokens, kvh, hd, device=DEVICE, dtype=dtype)
        v = torch.randn_like(k)
        slot = torch.randperm(slots, device=DEVICE)[:tokens]
        caches = [torch.zeros(kvh, slots, hd, device=DEVICE, dtype=dtype) for _ in range(4)]
        tri.write_kv(caches[0], caches[1], k, v, slot.to(torch.int32))
        ref.write_kv(caches[2], caches[3], k, v, slot)
        ok = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        checks.append(Check(f"write_kv {str(dtype)[6:]}", ok, 0.0 if ok else float("inf"), 0.0))


RANDOM_CONTEXT = 4096  # contexts drawn from [1, RANDOM_CONTEXT] where a case gives none
ATTENTION_CASES = {
    # name: (query_lens, seq_lens or None, kv_heads, group, head_dim, window, num_splits or None)
    "decode b64 gqa4 ctx<=4k": ([1] * 64, None, 8, 4, 128, None, None),
    "decode b8 gqa8 split": ([1] * 8, [1, 17, 600, 4000, 4095, 2049, 31, 8191], 8, 8, 128, None, 8),
    "decode b16 mha window": ([1] * 16, None, 16, 1, 128, 1000, None),
    "decode b32 gqa2 hd64": ([1] * 32, None, 4, 2, 64, None, None),
    "mixed prefill+verify+decode gqa4": ([512, 256, 5, 1, 1, 33], [512, 1256, 3005, 77, 2000, 33],
                                         8, 4, 128, None, None),
    "mixed prefill gqa8 window split": ([300, 5, 1], [1300, 700, 4000], 4, 8, 128, 256, 4),
}


def check_attention(checks: list[Check], quick: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, (qlens, lens, kvh, group, hd, window, splits) in ATTENTION_CASES.items():
        if lens is None:
            lens = torch.randint(1, RANDOM_CONTEXT + 1, (len(qlens),), generator=gen).tolist()
        for dtype in DTYPES[1:] if quick else DTYPES:
            b = make_batch(qlens, lens, kvh, group, hd, dtype, seed=len(checks))
            out = torch.full_like(b.q, float("nan"))
            run_triton_attention(b, window, splits, out=out)
            err = _rel_err(out, reference_attention(b, window))
            checks.append(Check(f"attention {name} {str(dtype)[6:]}", err <= TOL[dtype], err, TOL[dtype]))


def check_quant(checks: list[Check], quick: bool) -> None:
    from tokenyard.kernels import quant_layout as ql
    from tokenyard.kernels import quant_matmul_torch as ref
    from tokenyard.kernels import quant_matmul_triton as tri
    n, k = QUANT_CHECK["n"], QUANT_CHECK["k"]
    w = torch.randn(n, k, device=DEVICE) * 0.02
    q8 = ql.quantize_int8(w)
    q4 = {g: ql.quantize_int4(w, g) for g in (32, 64, 128)}
    for dtype in DTYPES[1:] if quick else DTYPES:
        for m in QUANT_CHECK["ms"]:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            out = tri.int8_matmul(x, q8.w_q, q8.scales.to(dtype))
            err = _rel_err(out, ref.int8_matmul(x.float(), q8.w_q, q8.scales.to(dtype)))
            checks.append(Check(f"int8 m={m} {str(dtype)[6:]}", err <= TOL[dtype], err, TOL[dtype]))
            for g, q in q4.items():
                out = tri.int4_matmul(x, q.packed, q.scales, q.zeros, g)
                err = _rel_err(out, ref.int4_matmul(x.float(), q.packed, q.scales, q.zeros, g))
                checks.append(Check(f"int4 g{g} m={m} {str(dtype)[6:]}", err <= TOL[dtype], err, TOL[dtype]))


# ----------------------------------------------------------------------------------------------
# (b) timings

def time_ms(fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median device time of fn on this run's device (see gpu_timing.time_ms)."""
    return gpu_timing.time_ms(fn, DEVICE, iters, warmup)


def time_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    """SDPA over contiguous KV with native GQA; heads expanded if this torch cannot do that."""
    try:
        return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def copy_bandwidth() -> float:
    """Bytes/ms of a large device-to-device copy on this run's device (read + write counted)."""
    return gpu_timing.copy_bandwidth(DEVICE, COPY_ELEMS)


def _attention_bytes(b: Batch) -> int:
    # Each sequence's K and V read once, plus q and out: the least any kernel must move.
    kvh, _, hd = b.k_cache.shape
    return sum(b.lens) * kvh * hd * 2 * b.k_cache.element_size() + 2 * b.q.numel() * b.q.element_size()


def time_attention(bw: float, timings: list[Timing]) -> None:
    dtype = TIMING_DTYPE
    kvh, group, hd = 8, 4, 128
    for batch, ctx in DECODE_TIMINGS:
        b = make_batch([1] * batch, [ctx] * batch, kvh, group, hd, dtype)
        nbytes = _attention_bytes(b)
        ms = time_ms(lambda: run_triton_attention(b))
        # SDPA over KV already gathered into contiguous [B, kvh, L, hd] (the gather not timed).
        k = torch.randn(batch, kvh, ctx, hd, device=DEVICE, dtype=dtype)
        v = torch.randn_like(k)
        qd = b.q.view(batch, kvh * group, 1, hd)
        base = time_sdpa(qd, k, v, causal=False)
        timings.append(Timing(f"decode b{batch} ctx{ctx} gqa{group}", ms, nbytes, nbytes / bw,
                              "sdpa contiguous", base))
    for seqs, length in PREFILL_TIMINGS:
        b = make_batch([length] * seqs, [length] * seqs, kvh, group, hd, dtype)
        ms = time_ms(lambda: run_triton_attention(b))
        qd = b.q.view(seqs, length, kvh * group, hd).transpose(1, 2)
        k = torch.randn(seqs, kvh, length, hd, device=DEVICE, dtype=dtype)
        v = torch.randn_like(k)
        base = time_sdpa(qd, k, v, causal=True)
        flops = 4 * seqs * kvh * group * hd * length * (length + 1) / 2
        timings.append(Timing(f"prefill {seqs}x{length} gqa{group}", ms, _attention_bytes(b),
                              _attention_bytes(b) / bw, "sdpa causal", base,
                              {"tflops": flops / ms / 1e9, "sdpa_tflops": flops / base / 1e9}))
    batch, rows, ctx = VERIFY_TIMING  # a speculative verify pass: k drafted tokens + 1
    b = make_batch([rows] * batch, [ctx] * batch, kvh, group, hd, dtype)
    ms = time_ms(lambda: run_triton_attention(b))
    timings.append(Timing(f"verify b{batch} q{rows} ctx{ctx}", ms, _attention_bytes(b), _attention_bytes(b) / bw))

    from tokenyard.kernels.paged_attention_triton import write_kv
    tokens, slots = WRITE_KV_TIMING["tokens"], WRITE_KV_TIMING["slots"]
    kc = torch.zeros(kvh, slots, hd, device=DEVICE, dtype=dtype)
    vc = torch.zeros_like(kc)
    kn = torch.randn(tokens, kvh, hd, device=DEVICE, dtype=dtype)
    vn = torch.randn_like(kn)
    slot = torch.randperm(slots, device=DEVICE)[:tokens].to(torch.int32)
    ms = time_ms(lambda: write_kv(kc, vc, kn, vn, slot))
    nbytes = 4 * kn.numel() * kn.element_size()
    timings.append(Timing(f"write_kv {tokens} tokens", ms, nbytes, nbytes / bw))


def time_quant(bw: float, timings: list[Timing]) -> None:
    from tokenyard.kernels import quant_layout as ql
    from tokenyard.kernels import quant_matmul_triton as tri
    dtype = TIMING_DTYPE
    for n, k in QUANT_TIMINGS["shapes"]:
        w = torch.randn(n, k, device=DEVICE) * 0.02
        q8 = ql.quantize_int8(w, scale_dtype=dtype)
        q4 = ql.quantize_int4(w, 128, scale_dtype=dtype)
        dense = w.to(dtype)
        for m in QUANT_TIMINGS["ms"]:
            x = torch.randn(m, k, device=DEVICE, dtype=dtype)
            io = (m * k + m * n) * x.element_size()
            base = time_ms(lambda: x @ dense.t())
            ms = time_ms(lambda: tri.int8_matmul(x, q8.w_q, q8.scales))
            nbytes = n * k + io
            timings.append(Timing(f"int8 {n}x{k} m={m}", ms, nbytes, nbytes / bw, f"dense {str(dtype)[6:]}", base))
            ms = time_ms(lambda: tri.int4_matmul(x, q4.packed, q4.scales, q4.zeros, 128))
            nbytes = n * k // 2 + 3 * n * (k // 128) + io
            timings.append(Timing(f"int4 g128 {n}x{k} m={m}", ms, nbytes, nbytes / bw, f"dense {str(dtype)[6:]}",
                                  base))


# ----------------------------------------------------------------------------------------------

def shrink_for_dry_run() -> None:
    """Toy sizes on the CPU, kernels under Triton's interpreter: the same functions, in seconds.
    bf16 kernel parity is left to tests/kernels/test_triton_kernels.py there (the interpreter's own bf16
    dot is wrong; the tests correct it), so its rows here say skip."""
    g = globals()
    g.update(DEVICE="cpu", TIMING_DTYPE=torch.float32, DTYPES=(torch.float32, torch.float16), COPY_ELEMS=1 << 20,
             RANDOM_CONTEXT=80, WRITE_KV_CHECK=dict(tokens=37, kv_heads=2, head_dim=32, slots=256),
             QUANT_CHECK=dict(n=64, k=128, ms=(1, 5)), DECODE_TIMINGS=((2, 64),), PREFILL_TIMINGS=((1, 32),),
             VERIFY_TIMING=(2, 3, 64), WRITE_KV_TIMING=dict(tokens=32, slots=256),
             QUANT_TIMINGS=dict(shapes=((64, 128),), ms=(1,)), DECODE=dict(batches=[1, 3], context=20, steps=2),
             TP=dict(prompts=3, max_tokens=4), W2=dict(requests=4, scale_output=0.05),
             ATTENTION_CASES={"decode b3 gqa4": ([1] * 3, None, 2, 4, 32, None, None),
                              "decode b2 window split": ([1, 1], [70, 20], 2, 2, 32, 16, 2),
                              "mixed prefill+decode gqa2": ([9, 1], [40, 33], 2, 2, 32, None, None)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="gpu_check.json", help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="skip fp32 correctness cases")
    parser.add_argument("--no-timings", action="store_true", help="correctness only")
    parser.add_argument("--no-decode", action="store_true", help="skip the end-to-end 1B decode (eager vs graphs)")
    parser.add_argument("--no-engine", action="store_true", help="skip the tp2 and W2 rows")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on the CPU at toy sizes (Triton interpreted): proves the script, not the GPU")
    args = parser.parse_args(argv)
    if args.dry_run:
        # Before triton is first imported (kernels/ import it lazily, below): interpret kernels.
        os.environ["TRITON_INTERPRET"] = "1"
        shrink_for_dry_run()
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch (torch.cuda.is_available() is False); "
              "this check needs an NVIDIA GPU. On the CPU: tokenyard/bench/gpu_check.sh --dry-run, "
              "pytest tests/kernels/test_triton_kernels.py")
        return 2
    import triton
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references must be fp32
    torch.manual_seed(0)
    device = "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()
    print(f"device {device}, torch {torch.__version__}, triton {triton.__version__}")

    checks: list[Check] = []
    check_write_kv(checks)
    check_attention(checks, args.quick)
    check_quant(checks, args.quick)
    print(f"\n{'check':58} {'rel err':>10} {'tol':>8}")
    for c in checks:
        print(f"{c.name:58} {c.rel_err:10.2e} {c.tol:8.0e} {'ok' if c.ok else 'FAIL'}")

    timings: list[Timing] = []
    bw = float("nan")
    if not args.no_timings:
        bw = copy_bandwidth()
        print(f"\ncopy bandwidth {bw / 1e6:.0f} GB/s ({2 * COPY_ELEMS / 2**30:.3f} GiB device copy, "
              "read + write); floor = bytes moved / this")
        time_attention(bw, timings)
        time_quant(bw, timings)
        print(f"\n{'kernel':32} {'ms':>8} {'floor ms':>9} {'% floor':>8} {'baseline':>16} {'base ms':>8}")
        for t in timings:
            extra = " ".join(f"{k}={v:.0f}" for k, v in t.extra.items())
            print(f"{t.name:32} {t.ms:8.3f} {t.floor_ms:9.3f} {100 * t.floor_ms / t.ms:7.0f}% "
                  f"{t.baseline:>16} {t.baseline_ms:8.3f} {extra}")

    decode = []
    if not args.no_timings and not args.no_decode:
        from tokenyard.bench import gpu_decode
        decode = gpu_decode.run(DECODE["batches"], context=DECODE["context"], steps=DECODE["steps"],
                                bandwidth_bytes_per_ms=bw, dry_run=args.dry_run)
        gpu_decode.print_table(decode)

    from tokenyard.bench.gpu_check_summary import Row, engine_rows, print_summary, summary_rows
    rows = summary_rows(checks, timings, decode, args.dry_run)
    if not args.no_engine:
        rows += engine_rows(args.dry_run, DEVICE, TP, W2)
    leaked = sorted(m for m in sys.modules if m == "tokenyard.gateway" or m.startswith("tokenyard.gateway."))
    rows.append(Row("layering", "engines/ and kernels/ without gateway/", "FAIL" if leaked else "ok",
                    f"imported: {', '.join(leaked[:5])}" if leaked else "no gateway module imported"))
    print_summary(rows)
    failed = [f"{r.section}: {r.name}" for r in rows if r.status == "FAIL"]

    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "triton": triton.__version__, "dry_run": args.dry_run,
                   "copy_bandwidth_GBps": bw / 1e6, "checks": [asdict(c) for c in checks],
                   "timings": [asdict(t) for t in timings], "decode": [asdict(d) for d in decode],
                   "summary": [asdict(r) for r in rows], "failed": failed}, f, indent=1)
    n_ok = sum(r.status == "ok" for r in rows)
    print(f"\nwrote {args.out}; {n_ok} ok, {len(failed)} FAIL, {sum(r.status == 'skip' for r in rows)} skip")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
