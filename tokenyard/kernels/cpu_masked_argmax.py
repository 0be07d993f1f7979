"""Greedy tokens under grammar masks on the CPU, in C (masked_argmax.c): no masked copy of the logits.

    kernel = cpu_masked_argmax.load()        # None: no C compiler, a failed build, or disabled
    tokens = kernel.argmax(logits, rows, bitmask, vocab)   # logits [S, V] fp32; bitmask int32 [R, W]

Why: a constrained greedy row used to be masked by one torch.where over the batch (a new [S, V] tensor)
and then argmax'd; at batch 32 on SmolLM2 that select alone cost 1-4 ms of a 70 ms decode step on a
2-core VM, most of what json_schema added to TPOT (bench/RESULTS.md). The kernel walks each row's set
bits and reads only those logits. Same tokens as numpy's argmax over the masked copy (first maximum; a
NaN wins; 0 when nothing allowed beats -inf): tests/kernels/test_cpu_masked_argmax.py.

`TOKENYARD_MASKED_ARGMAX=torch` keeps the torch select (read on every call).
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from tokenyard import knobs
from tokenyard.nativelib.build import cached_library, load_once

SOURCE = Path(__file__).with_name("masked_argmax.c")
FLAGS = ("-O2", "-march=native", "-shared", "-fPIC")
_LOCK = threading.Lock()
_LOADED: dict[str, "Kernel | None"] = {}


class Kernel:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        self._fn = lib.tokenyard_masked_argmax
        self._fn.argtypes = [vp, i64, vp, vp, i64, i64, i64, vp]
        self._fn.restype = None

    @staticmethod
    def supports(logits: torch.Tensor) -> bool:
        return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1

    def argmax(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, vocab: int) -> list[int]:
        """Row j of the answer: the greedy token of logits[rows[j]] among those bitmask[j] allows."""
        if not self.supports(logits):
            raise ValueError("masked argmax: fp32 CPU logits with unit stride over the vocabulary")
        if bitmask.dtype != torch.int32 or bitmask.shape[0] != len(rows) or bitmask.shape[1] * 32 < vocab:
            raise ValueError(f"masked argmax: an int32 [{len(rows)}, >= {(vocab + 31) // 32}] bitmask, "
                             f"got {bitmask.dtype} {list(bitmask.shape)}")
        if vocab > logits.shape[-1] or any(r < 0 or r >= logits.shape[0] for r in rows):
            raise ValueError("masked argmax: rows or vocabulary outside the logits")
        bitmask = bitmask.contiguous()
        at = torch.tensor(rows, dtype=torch.int64)
        out = torch.empty(len(rows), dtype=torch.int64)
        self._fn(logits.data_ptr(), logits.stride(0), at.data_ptr(), bitmask.data_ptr(), bitmask.shape[1],
                 len(rows), vocab, out.data_ptr())
        return out.tolist()


def load() -> Kernel | None:
    """The kernel, built on first use; None when TOKENYARD_MASKED_ARGMAX=torch or it cannot be built
    (a warning, once: the torch select serves)."""
    if not knobs.masked_argmax_native():
        return None
    return load_once(_LOADED, _LOCK, "kernel", lambda: Kernel(cached_library(SOURCE, FLAGS, "masked_argmax")),
                     "grammar masks (masked argmax)")
