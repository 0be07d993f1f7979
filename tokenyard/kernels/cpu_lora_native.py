"""The LoRA products of one fused projection in C (cpu_lora.c): every adapter segment of a step in one call.

    kernel = cpu_lora_native.load()            # None: no C compiler, a failed build, or disabled
    group = kernel.group(a, b, rank, modules)  # once per layer and group: the pool's [slots, G*R, in] / [slots, G*R, out]
    segs = kernel.segments(seg)                # once per step, from lora_torch.LoraSegments
    kernel.add(y, x, group, segs)              # y += each row's adapter product, in place

Why: the torch forms cost about five calls per fused projection (lora_torch.py), which at decode sizes
are most of what serving adapters adds to a CPU step; here a projection is one call that touches only
each adapter's own rank and each module's own block of the block-diagonal B.

The descriptors are ctypes structures that keep the tensors they point into alive: a group's A and B are
the pool's views (allocated once, written in place, so the pointers stay valid), a step's segments are
tensors made once per step. fp32 only; other dtypes keep the torch forms.

Build: tokenyard/nativelib/build.py's cache (~/.cache/tokenyard/native), -O3 -march=native with
-fopenmp (the library then shares torch's OpenMP runtime and threads); without OpenMP it is built again
single-threaded. `TOKENYARD_CPU_LORA=torch` keeps the torch forms.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from tokenyard import knobs
from tokenyard.nativelib.build import cached_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.c")
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-shared", "-fPIC")
MAX_MODULES = 3
_LOCK = threading.Lock()
_LOADED: dict[str, "Kernel | None"] = {}

i64 = ctypes.c_int64


class Group(ctypes.Structure):
    _fields_ = [("k", i64), ("n", i64), ("width", i64), ("rank", i64), ("n_modules", i64),
                ("index", i64 * MAX_MODULES), ("off", i64 * MAX_MODULES), ("cols", i64 * MAX_MODULES),
                ("a", ctypes.c_void_p), ("b", ctypes.c_void_p)]


class Segments(ctypes.Structure):
    _fields_ = [("n_segments", i64), ("perm", ctypes.c_void_p), ("starts", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("ranks", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("item_seg", ctypes.c_void_p), ("item_lo", ctypes.c_void_p), ("n_items", i64)]


def compile_library(out_dir: Path | None = None, openmp: bool = True) -> Path:
    """Path of the built library (compiled now if this source and flags have no build yet)."""
    flags = (*BASE_FLAGS, "-fopenmp") if openmp else BASE_FLAGS
    return cached_library(SOURCE, flags, "lora" if openmp else "lora-serial", out_dir)


class Kernel:
    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self._add = lib.tokenyard_lora_add
        self._add.argtypes = [ctypes.c_void_p, i64, ctypes.c_void_p, i64, ctypes.POINTER(Group),
                              ctypes.POINTER(Segments)]
        self._add.restype = ctypes.c_int
        self.max_width = lib.tokenyard_lora_max_width()
        self.rows_per_item = lib.tokenyard_lora_rows_per_item()

    def supports(self, a: torch.Tensor, num_modules: int, rank: int) -> bool:
        """Whether a pool group of this dtype and shape can take the kernel."""
        return (a.dtype == torch.float32 and a.device.type == "cpu" and num_modules <= MAX_MODULES
                and a.shape[-2] <= self.max_width and num_modules * rank <= self.max_width)

    def group(self, a: torch.Tensor, b: torch.Tensor, rank: int, modules: list[tuple[int, int, int]]) -> Group:
        """A group's descriptor. a: [slots, W, in]; b: [slots, W, out], both contiguous fp32 (the pool's
        tensors of one layer); modules: (index in the group, output column offset, width) of each adapted
        module."""
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError("LoRA kernel: the pool's A and B must be contiguous")
        g = Group(k=a.shape[2], n=b.shape[2], width=a.shape[1], rank=rank, n_modules=len(modules),
                  a=a.data_ptr(), b=b.data_ptr())
        for i, (j, off, n) in enumerate(modules):
            g.index[i], g.off[i], g.cols[i] = j, off, n
        g._keep = (a, b)    # type: ignore[attr-defined]  # the storage the pointers read
        return g

    def segments(self, perm: torch.Tensor, starts: list[int], slots: list[int], ranks: list[int],
                 scales: list[float]) -> Segments:
        """A step's segments: perm [rows] long (each adapter's rows contiguous), starts [S + 1], and per
        segment its slot, rank and scale. Work items of up to rows_per_item rows are cut here, once."""
        mr = self.rows_per_item
        item_seg, item_lo = [], []
        for i in range(len(slots)):
            for lo in range(starts[i], starts[i + 1], mr):
                item_seg.append(i)
                item_lo.append(lo)
        keep = (perm.to(torch.int64).contiguous(), torch.tensor(starts, dtype=torch.int64),
                torch.tensor(slots, dtype=torch.int64), torch.tensor(ranks, dtype=torch.int64),
                torch.tensor(scales, dtype=torch.float32), torch.tensor(item_seg, dtype=torch.int64),
                torch.tensor(item_lo, dtype=torch.int64))
        s = Segments(len(slots), *(t.data_ptr() for t in keep), len(item_seg))
        s._keep = keep     # type: ignore[attr-defined]
        return s

    def add(self, y: torch.Tensor, x: torch.Tensor, group: Group, segs: Segments) -> None:
        """y [T, N] += each row's adapter product of x [T, K], in place (rows of unit column stride)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        if y.stride(1) != 1:
            raise ValueError("LoRA kernel: the output's columns must be contiguous")
        if self._add(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), group, segs) != 0:
            raise ValueError(f"LoRA kernel: a group of width {group.width} does not fit (at most {self.max_width})")


def load() -> Kernel | None:
    """The kernel, built on first use; None when TOKENYARD_CPU_LORA=torch or it cannot be built (a
    warning, once: the torch forms serve)."""
    if not knobs.cpu_lora_native():
        return None
    with _LOCK:
        if "kernel" not in _LOADED:
            kernel = None
            for openmp in (True, False):
                try:
                    kernel = Kernel(compile_library(openmp=openmp))
                    break
                except (OSError, RuntimeError) as exc:
                    log.warning("CPU LoRA kernel: %s build unavailable (%s)", "OpenMP" if openmp else "serial", exc)
            if kernel is None:
                log.warning("CPU LoRA kernel: unavailable; the torch forms serve")
            _LOADED["kernel"] = kernel
        return _LOADED["kernel"]
