"""F.linear (MKL's sgemm) against oneDNN's packed product (tokenyard/engines/model/onednn_linear.py) on the W2
model's four projection shapes, fp32, at several row counts (tokens in one eager step).

    .venv/bin/python -m tokenyard.bench.onednn_linear_bench [--rows 1 8 32 96 256 512] [--rounds 5] [--threads 2]

Per shape and row count: the best of `--rounds` timings of each product after a warm-up call, as
GFLOP/s, and their ratio; plus what the engine's "auto" rule measures at start-up
(onednn_linear.measured_speedup on the largest projection at 512 rows). Raw output:
bench/results/<--results-name, default onednn_linear>.json.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tokenyard.bench.kernel_micro import best_ms
from tokenyard.bench.results_io import RunRecorder
from tokenyard.bench.workloads import W2_MODEL
from tokenyard.engines.model import onednn_linear


def shapes() -> dict[str, tuple[int, int]]:
    d, inter = W2_MODEL["hidden_size"], W2_MODEL["intermediate_size"]
    head_dim = d // W2_MODEL["num_attention_heads"]
    kv = W2_MODEL["num_key_value_heads"] * head_dim
    return {"qkv": (d, d + 2 * kv), "o": (d, d), "gate_up": (d, 2 * inter), "down": (inter, d)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 96, 256, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results-name", default="onednn_linear")
    args = ap.parse_args()
    if not onednn_linear.available():
        raise SystemExit("this torch build has no oneDNN linear ops")
    torch.set_num_threads(args.threads)
    rec = RunRecorder(args.results_name)
    g = torch.Generator().manual_seed(0)
    runs = []
    with torch.inference_mode():
        for name, (k, n) in shapes().items():
            w = torch.randn(n, k, generator=g)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=512)
            for m in args.rows:
                x = torch.randn(m, k, generator=g)
                plain = best_ms(lambda: F.linear(x, w), args.rounds) / 1e3
                onednn = best_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                 args.rounds) / 1e3
                flop = 2 * m * k * n
                runs.append({"shape": name, "in": k, "out": n, "rows": m, "f_linear_ms": plain * 1e3,
                             "onednn_ms": onednn * 1e3, "f_linear_gflops": flop / plain / 1e9,
                             "onednn_gflops": flop / onednn / 1e9, "speedup": plain / onednn})
                r = runs[-1]
                print(f"{name:8s} {k}x{n} rows {m:4d}: F.linear {r['f_linear_gflops']:6.1f} GFLOP/s, oneDNN "
                      f"{r['onednn_gflops']:6.1f} GFLOP/s, {r['speedup']:.2f}x", flush=True)
    k, n = shapes()["gate_up"]
    auto = onednn_linear.measured_speedup(k, n, 512)
    print(f"the engine's auto probe (gate_up at 512 rows): {auto:.2f}x")
    by_rows = {m: sum(r["f_linear_ms"] for r in runs if r["rows"] == m) /
               sum(r["onednn_ms"] for r in runs if r["rows"] == m) for m in args.rows}
    rec.write({"threads": args.threads, "auto_probe_speedup": auto,
               "layer_speedup_by_rows": {str(m): v for m, v in by_rows.items()}}, runs=runs)
    for m, v in by_rows.items():
        print(f"one layer's four products at {m} rows: {v:.2f}x")


if __name__ == "__main__":
    main()
