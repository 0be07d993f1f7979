"""Keep freed memory in the process on CPU hosts.

Every engine step allocates and frees many multi-megabyte temporaries (gathered K/V, scores,
activations). glibc serves blocks above its mmap threshold with fresh mmap() calls and returns
freed heap tops to the OS, so each step page-faults and zero-fills the same memory again; on a
two-core machine that cost was a third of decode attention time. Raising the mmap threshold to
its maximum and never trimming keeps those pages mapped and reused. This is what jemalloc or
tcmalloc would give, without an LD_PRELOAD.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MADV_DONTNEED = 4
_MADV_REMOVE = 9        # shared anonymous mappings (Python's mmap(-1, n)): frees their backing pages
_done = False


def keep_freed_memory() -> bool:
    """Apply the glibc settings once per process; False where not glibc (nothing changes)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)   # glibc's maximum on 64-bit
    ok &= mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    ok &= mallopt(_M_TOP_PAD, 64 * 1024 * 1024)
    _done = bool(ok)
    if not ok:
        log.debug("mallopt refused the allocator settings; continuing with defaults")
    return _done


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the OS now (glibc malloc_trim), after a large release such as
    a sleeping engine's KV cache: keep_freed_memory() above turned automatic trimming off. False where
    not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def discard_pages(ptr: int, nbytes: int) -> bool:
    """Give the pages of [ptr, ptr + nbytes) of an anonymous mapping back to the OS now (madvise
    MADV_REMOVE for a shared one, else MADV_DONTNEED); the mapping stays where it is and reads as zeros until written again. Only
    whole pages inside the range are dropped. False where that is not possible (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    page = mmap.PAGESIZE
    start = -(-ptr // page) * page
    end = (ptr + nbytes) // page * page
    if end <= start:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_REMOVE) == 0:
            return True
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return False


def resident_bytes(ptr: int, nbytes: int) -> int:
    """Bytes of the pages of [ptr, ptr + nbytes) resident in memory (mincore; page-aligned ptr); 0
    where that cannot be asked (not Linux)."""
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return 0
    page = mmap.PAGESIZE
    pages = -(-nbytes // page)
    vec = (ctypes.c_ubyte * pages)()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), vec) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return sum(b & 1 for b in vec) * page
