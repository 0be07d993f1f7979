"""Timing on a device for the GPU check scripts: median device time with the L2 cache flushed, and the
copy bandwidth that the roofline figures are measured against. On the CPU (the dry run) the wall
clock stands in: the figures there only prove the plumbing."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

_flush: dict[str, torch.Tensor] = {}


def time_ms(fn: Callable[[], object], device: str, iters: int = 20, warmup: int = 3) -> float:
    """Median time of fn in ms; on CUDA by events, L2 flushed before each run (outside the events)."""
    if device == "cpu":
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    flush = _flush.get(device)
    if flush is None:
        flush = _flush[device] = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: str, elems: int = 1 << 30) -> float:
    """Bytes/ms of a large device-to-device copy of `elems` fp16 values (read + write counted)."""
    src = torch.empty(elems, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10)
    return 2 * src.numel() * src.element_size() / ms
