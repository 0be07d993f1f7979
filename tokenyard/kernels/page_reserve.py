"""Huge pages faulted in ahead of need, while the engine core imports torch (issue 52, item 1).

Why: the C decode step's weights live in one huge-page arena (hugepage_arena.py), and the first touch
of ~100 MB of fresh 2 MiB pages is not always cheap. On this project's 2-core Firecracker VMs it took
15-20 ms in most processes and 235-345 ms in some (a plain C memset of 100 MB, no Tokenyard). Those
VMs' balloon device offers free page reporting (virtio-balloon's REPORTING feature): the guest hands
free 2 MiB blocks back to the host, which backs them again only when they are touched, and huge
pages come from exactly such blocks; SmolLM2's replica showed it as a `compile` phase of
0.34 s instead of 0.07 s in 3 of 12 starts, the starts that missed the 2 s ready goal.

An engine core spends its first 1.4 s in one thread importing torch, with the second core idle.
`start(hint_key)` runs there, before that import: when an earlier build with the same recipe left a
size hint (a small JSON file beside the prepared-weights cache), a daemon thread maps that many
bytes, asks for huge pages and touches one byte per 2 MiB page, each touch a ctypes call that lets
go of the GIL, so the faults are paid on the idle core. `take(nbytes)` hands the mapping to the
arena when it is large enough (and records the size the arena asked for, for the next start);
`release()` unmaps a reservation nobody took (an engine without the C step), so it costs nothing
after the build. Any failure leaves the arena to map its own memory, as before.

Nothing here imports torch: the core calls it before torch is imported. TOKENYARD_HUGE_PAGES=off
or TOKENYARD_WEIGHT_CACHE=off turn it off (no huge pages wanted; nowhere to keep the hint).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tokenyard import knobs

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MAX_HINT_BYTES = 64 << 30          # a hint above this is not trusted (a corrupt or foreign file)


class _Reservation:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.map: mmap.mmap | None = None
        self.huge = False
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._fault, name="tokenyard-page-reserve", daemon=True)

    def _fault(self) -> None:
        t0 = time.perf_counter()
        try:
            m = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except (OSError, AttributeError):
                pass
            anchor = ctypes.c_char.from_buffer(m)
            base = ctypes.addressof(anchor)
            try:
                for at in range(0, self.nbytes, HUGE_PAGE):
                    ctypes.memset(base + at, 0, 1)      # a write faults the page in; the call drops the GIL
            finally:
                del anchor                           # the mapping must have no exported buffer when taken
            self.map = m
        except (OSError, ValueError, BufferError) as exc:
            log.debug("page reservation of %d bytes failed (%s); the arena maps its own", self.nbytes, exc)
        self.seconds = time.perf_counter() - t0


_lock = threading.Lock()
_pending: _Reservation | None = None
_hint_path: Path | None = None
_asked = 0                          # the largest size an arena asked for in this process


def hint_key(kind: str, model: str | os.PathLike[str], options: dict[str, Any]) -> str:
    """A key for a recipe's hint: its kind, model path (with size and mtime when it is a file) and
    options. A stale hint only costs a reservation that is too small (dropped) or too large (unused room)."""
    path = Path(model)
    try:
        st = path.stat()
        ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    except OSError:
        ident = str(model)
    doc = json.dumps({"kind": kind, "model": ident, "options": options}, sort_keys=True, default=str)
    return hashlib.sha256(doc.encode()).hexdigest()[:32]


def _enabled() -> bool:
    return sys.platform.startswith("linux") and knobs.huge_pages() and knobs.weight_cache()


def start(key: str) -> bool:
    """Begin faulting in the hinted size for `key` on a thread; True when a reservation started.
    Either way, the size an arena asks for later in this process becomes the hint for `key`."""
    global _pending, _hint_path
    if not _enabled():
        return False
    _hint_path = Path(knobs.weight_cache_dir()) / f"arena-{key}.json"
    nbytes = _read_hint()
    if nbytes is None or not 0 < nbytes <= MAX_HINT_BYTES:
        return False
    with _lock:
        if _pending is not None:
            return False
        _pending = _Reservation(-(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        _pending.thread.start()
    return True


def take(nbytes: int) -> tuple[mmap.mmap, bool] | None:
    """The reserved mapping (and whether it asked for huge pages) when it holds nbytes, else None;
    records nbytes as the hint for the next start either way."""
    global _pending, _asked
    _asked = max(_asked, nbytes)
    _write_hint()
    with _lock:
        r, _pending = _pending, None
    if r is None:
        return None
    r.thread.join()
    if r.map is None or not nbytes <= r.nbytes <= nbytes + nbytes // 4 + HUGE_PAGE:    # too small, or stale and large
        if r.map is not None:
            r.map.close()
        return None
    log.debug("took a reservation of %d bytes, faulted in %.3f s beside the imports", r.nbytes, r.seconds)
    return r.map, r.huge


def release() -> None:
    """Unmap a reservation nobody took (called once the engine is built)."""
    global _pending
    with _lock:
        r, _pending = _pending, None
    if r is not None:
        r.thread.join()
        if r.map is not None:
            r.map.close()


def _read_hint() -> int | None:
    """The hinted size, or None (no hint, or one that is not {"bytes": N})."""
    if _hint_path is None:
        return None
    try:
        doc = json.loads(_hint_path.read_text())
        value = doc["bytes"] if isinstance(doc, dict) else None
    except (OSError, ValueError, KeyError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _write_hint() -> None:
    if _hint_path is None or _read_hint() == _asked:
        return
    try:
        _hint_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _hint_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"bytes": _asked}))
        os.replace(tmp, _hint_path)
    except OSError:
        log.debug("could not write the arena size hint %s", _hint_path)
