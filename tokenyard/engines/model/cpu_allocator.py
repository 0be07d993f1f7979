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
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
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
