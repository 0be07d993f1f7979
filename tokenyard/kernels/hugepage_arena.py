"""One block of memory backed by transparent huge pages, for the tensors a decode step streams.

    arena = HugePageArena.holding([w1, w2, ...])     # copies; arena.view(i) is tensor i's new home
    module.weight.data = arena.view(0)

Why: a batch-1 decode step reads every weight once, and at that rate the page size matters: a
107 MB read touches 26,000 pages of 4 KiB and every TLB miss costs a page walk. On this project's
2-core EPYC VM a sum over 107 MB of floats ran markedly faster from 2 MiB pages than from 4 KiB
ones (tokenyard/bench/page_bandwidth.py; bench/RESULTS.md, "Native CPU decode step"). torch's allocator
gives ordinary pages, and the kernel's default (THP "madvise") gives huge pages only to memory that
asks for them, so the arena is an anonymous mmap that asks (madvise(MADV_HUGEPAGE)) before it is
first touched.

Where huge pages are not available (another OS, THP "never") the arena is ordinary memory and
everything works as before; TOKENYARD_HUGE_PAGES=off asks for ordinary pages (to measure the
difference: tokenyard/bench/page_bandwidth.py). The arena is never freed while a view of it lives: each view holds
the mmap through torch.frombuffer.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import sys

import torch

from tokenyard import knobs
from tokenyard.kernels import page_reserve

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64          # every tensor starts on a cache line


class HugePageArena:
    def __init__(self, nbytes: int) -> None:
        size = max(HUGE_PAGE, -(-nbytes // HUGE_PAGE) * HUGE_PAGE) + HUGE_PAGE   # room to align the start
        wanted = knobs.huge_pages()
        # pages an engine core faulted in while it imported torch (page_reserve.py says why)
        reserved = page_reserve.take(size) if wanted else None
        if reserved is not None:
            self._map, self.huge = reserved
            size = len(self._map)
        else:
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.huge = False
        if reserved is None and wanted and sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError as exc:   # THP compiled out: ordinary pages
                log.debug("madvise(MADV_HUGEPAGE) refused (%s); the arena uses ordinary pages", exc)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._next = (-self._bytes.data_ptr()) % HUGE_PAGE
        self._views: list[torch.Tensor] = []
        self.capacity = size

    @classmethod
    def holding(cls, tensors: list[torch.Tensor]) -> "HugePageArena":
        """An arena with a copy of each tensor (in order: `view(i)`)."""
        arena = cls(sum(_padded(t) for t in tensors))
        for t in tensors:
            arena.place(t)
        return arena

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t inside the arena (its storage is the arena's)."""
        n = t.numel() * t.element_size()
        if self._next + n > self.capacity:
            raise ValueError(f"arena full: {n} more bytes at {self._next} of {self.capacity}")
        view = self._bytes[self._next:self._next + n].view(t.dtype).view(t.shape)
        if t.device.type == "cpu" and t.is_contiguous() and n:
            # one memcpy on this thread: copy_ opens an OpenMP region per tensor, and with a core
            # busy elsewhere each one waits for its second thread (1.2 s instead of 0.02 s for
            # SmolLM2's 421 tensors on this 2-core VM under load)
            ctypes.memmove(view.data_ptr(), t.data_ptr(), n)
        else:
            view.copy_(t)
        self._next += _padded(t)
        self._views.append(view)
        return view

    def view(self, i: int) -> torch.Tensor:
        return self._views[i]

    @property
    def used(self) -> int:
        return self._next


def _padded(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return -(-n // ALIGN) * ALIGN
