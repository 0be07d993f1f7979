"""Paged decode attention on the CPU in C (cpu_decode_attention.c), reading blocks in place.

    kernel = cpu_decode_native.load()      # None: no C compiler, a failed build, or disabled
    out = kernel.attend(qd, k_cache, v_cache, blocks, mask, scale)    # [B, kvh, rows, hd]

Why: over an int8 cache the torch forms gather the codes, widen them into an fp32 buffer and
only then multiply (two extra passes over every key); at a 4k context that made an int8 decode
step level with an fp32 one although it reads a quarter of the bytes. Here the codes are widened
inside the dot products and the scales fold into scores and probabilities.

Build (tokenyard/nativelib/build.py: cached in ~/.cache/tokenyard/native): -O3 -march=native (the vector
width of the machine it runs on) and reassociation allowed for the dot products (no -ffast-math:
masks are -inf).
`TOKENYARD_CPU_ATTENTION=torch` keeps the torch forms (tokenyard/kernels/decode_group_torch.py).
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import torch

from tokenyard import knobs
from tokenyard.kernels.kv_quant import QuantizedCache
from tokenyard.nativelib.build import cached_library, load_once

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-shared", "-fPIC")
MAX_ROWS = 64            # query rows per kv head (n * group) the C kernel takes
_LOCK = threading.Lock()
_LOADED: dict[str, "Kernel | None"] = {}


def compile_library(out_dir: Path | None = None) -> Path:
    """Path of the built library (compiled now if this source and flags have no build yet)."""
    return cached_library(SOURCE, FLAGS, "decode_attention", out_dir)


class Kernel:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        args = [vp] * 7 + [i64] * 8 + [ctypes.c_float, vp, vp]
        self._fns = {}
        for name, dtype in (("tokenyard_decode_int8", torch.int8), ("tokenyard_decode_f32", torch.float32)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, k_cache: torch.Tensor | QuantizedCache, q: torch.Tensor, rows: int) -> bool:
        data = k_cache.data if isinstance(k_cache, QuantizedCache) else k_cache
        return (q.dtype == torch.float32 and data.dtype in self._fns and data.device.type == "cpu"
                and rows <= MAX_ROWS and data.is_contiguous())

    def attend(self, qd: torch.Tensor, k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache,
               blocks: torch.Tensor, mask: torch.Tensor, scale: float,
               work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """qd: [B, kvh, rows, hd] fp32; blocks: [B, nb] int64; mask: [B, n, nb * bs] fp32 additive.
        Returns (out [B, kvh, rows, hd], the work buffer, to pass back in on the next layer)."""
        batch, kvh, rows, hd = qd.shape
        nb = blocks.shape[1]
        n = mask.shape[1]
        length = mask.shape[2]
        bs = length // nb
        quantised = isinstance(k_cache, QuantizedCache)
        kd, vd = (k_cache.data, v_cache.data) if quantised else (k_cache, v_cache)
        ks, vs = (k_cache.scale.data_ptr(), v_cache.scale.data_ptr()) if quantised else (None, None)
        need = hd + rows * length
        if work is None or work.numel() < need:
            work = torch.empty(need, dtype=torch.float32)
        qd, blocks, mask = qd.contiguous(), blocks.contiguous().to(torch.int64), mask.contiguous()
        out = torch.empty_like(qd)
        rc = self._fns[kd.dtype](qd.data_ptr(), kd.data_ptr(), ks, vd.data_ptr(), vs, blocks.data_ptr(),
                                 mask.data_ptr(), batch, kvh, kd.shape[1], n, rows // n, hd, nb, bs, scale,
                                 out.data_ptr(), work.data_ptr())
        if rc != 0:
            raise ValueError(f"decode attention: {rows} query rows per kv head; the C kernel takes at most {MAX_ROWS}")
        return out, work


def load() -> Kernel | None:
    """The kernel, built on first use; None when TOKENYARD_CPU_ATTENTION=torch or it cannot be built
    (a warning, once: the torch forms serve)."""
    if not knobs.cpu_attention_native():
        return None
    return load_once(_LOADED, _LOCK, "kernel", lambda: Kernel(compile_library()), "CPU decode attention")
