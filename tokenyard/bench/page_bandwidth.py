"""How fast a core streams a small model's weights from 4 KiB pages vs 2 MiB (transparent huge) pages.

    .venv/bin/python -m tokenyard.bench.page_bandwidth [--mb 107] [--rounds 5] [--reps 20] [--threads 1 2]

A batch-1 decode step reads every weight once, so its floor is this read. The same `--mb` of fp32
(107 MB: the W2 model's weights read per token, the LM head included) is summed with torch from
an ordinary allocation and from tokenyard.kernels.hugepage_arena.HugePageArena (an mmap that asks for huge
pages before it is touched, where the C decode step keeps its weights); fastest of `--reps` sums
per round, rounds alternate the two, median over rounds, at each thread count. The figure is GB/s
of weights read. Writes bench/results/page_bandwidth.json (the JSON also records whether the
kernel gave the arena huge pages: AnonHugePages of the process).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from tokenyard.bench.results_io import RunRecorder
from tokenyard.kernels.hugepage_arena import HugePageArena


def _anon_huge_kib() -> int:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def best_ms(t: torch.Tensor, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        t.sum()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=107.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    args = ap.parse_args(argv)
    rec = RunRecorder("page_bandwidth")
    n = int(args.mb * 1e6 / 4)
    ordinary = torch.rand(n)
    arena = HugePageArena.holding([ordinary])
    huge = arena.view(0)
    runs, figures = [], {"mb": args.mb, "arena_asked_for_huge_pages": arena.huge, "anon_huge_kib": _anon_huge_kib()}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for r in range(args.rounds):
            for name, t in (("4k_pages", ordinary), ("huge_pages", huge)) if r % 2 == 0 else \
                    (("huge_pages", huge), ("4k_pages", ordinary)):
                ms = best_ms(t, args.reps)
                runs.append({"threads": threads, "round": r, "pages": name, "ms": ms, "gb_s": args.mb / ms})
        row = {}
        for name in ("4k_pages", "huge_pages"):
            ms = statistics.median(x["ms"] for x in runs if x["threads"] == threads and x["pages"] == name)
            row[name] = {"ms": ms, "gb_s": args.mb / ms}
        row["speedup"] = row["4k_pages"]["ms"] / row["huge_pages"]["ms"]
        figures[f"threads{threads}"] = row
        print(f"{threads} thread(s): 4 KiB pages {row['4k_pages']['ms']:.2f} ms ({row['4k_pages']['gb_s']:.1f} GB/s), "
              f"huge pages {row['huge_pages']['ms']:.2f} ms ({row['huge_pages']['gb_s']:.1f} GB/s): "
              f"{row['speedup']:.2f}x", flush=True)
    rec.write(figures=figures, runs=runs)


if __name__ == "__main__":
    main()
