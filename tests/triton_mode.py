"""Where the tests run the Triton kernels: compiled on a CUDA device, else interpreted on the CPU.

Imported first by tests/conftest.py. Triton fixes the mode when `@triton.jit` decorates a kernel
(at the first import of kernels/), so the choice is made once, before any test module imports
triton, and holds for the whole run. On a machine where torch sees CUDA nothing is set and the
kernels compile for real; elsewhere TRITON_INTERPRET=1 makes them run on CPU tensors. A
TRITON_INTERPRET already in the environment wins (TRITON_INTERPRET=1 on a GPU host checks the
interpreter path there).
"""
from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRETED else "cuda")


def patch_interpreter_bf16(monkeypatch) -> None:
    """Give the interpreter the GPU's bf16 semantics for one test.

    The interpreter keeps bf16 tensors as their uint16 bit patterns. Its bf16 loads and stores,
    and its bf16 -> fp32 cast, are right; three ops are not: tl.dot multiplies bf16 operands as
    integers, a cast from an integer (or fp16) to bf16 writes the number itself as the bit
    pattern, and fp32 -> bf16 truncates (error up to 2^-7) where the GPU rounds to nearest even
    (2^-8 at most). So: dot operands are widened to fp32 (exact: the bits shifted up 16) and
    multiplied and accumulated in the accumulator's fp32, as tensor cores do; fp32 -> bf16 is
    rounded to nearest even by torch; other casts to or from bf16 go through fp32.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    dot, cast = InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        ends = {src.dtype.scalar, dst_type.scalar}
        if tl.bfloat16 not in ends or len(ends) == 1:
            return cast(self, src, dst_type)
        if tl.float32 not in ends:
            src = cast(self, src, tl.float32)
        if dst_type.scalar == tl.bfloat16:
            fp32 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = fp32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return TensorHandle(bits.reshape(src.data.shape), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(InterpreterBuilder, "cast_impl", cast_impl)
