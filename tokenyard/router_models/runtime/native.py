"""The router's feature row in C (native_row.c), built once with the system C compiler.

    kernel = native.load()          # None: no compiler, a failed build, or TOKENYARD_ROUTER_NATIVE=0
    kernel.row(...)                 # one feature row (features.row calls this)

Why: the numpy path of `features.row` is about a hundred small array operations, and their
dispatch (not the arithmetic) made the decision cost ~300 us at a 512-character window; the
issue's budget is 200 us at p99 up to 8k-token prompts. The C pass computes the same columns in
the same order (tests/router/test_router_native.py compares the two bit for bit), so artifacts trained
with either path score identically with either.

Build: `cc -O2 -shared -fPIC` through tokenyard/nativelib/build.py (cached in ~/.cache/tokenyard/native
under a hash of source, flags and compiler; ~0.3 s the first time, then a file open). Without a
compiler, or if the build fails, the numpy path serves with one warning;
`TOKENYARD_ROUTER_NATIVE=0` chooses it outright (the results are the same, only slower).
"""
from __future__ import annotations

import ctypes
import logging
import threading
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenyard import knobs
from tokenyard.nativelib.build import cached_library, compiler

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native_row.c")
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


FLAGS = ("-O2", "-shared", "-fPIC")


def build(out_dir: Path | None = None) -> Path:
    """The shared library's path, compiling it if this source has no build yet; raises on failure."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    return cached_library(SOURCE, FLAGS, "router_row", out_dir, cc)


def _compiler() -> str | None:
    return compiler()


@dataclass(frozen=True, slots=True)
class NativeRow:
    cols: np.ndarray                 # int64 columns, block after block (features.Row.cols)
    ends: tuple[int, int, int]       # where the word, char and cross blocks end in cols
    dense: np.ndarray                # standardised dense values (features.Row.dense)
    factors: np.ndarray              # per block: its weight / the L2 norm of its counts
    sums: np.ndarray | None          # (4, n_weights): per hashed block, the sum of its occurrences'
                                     # weights; then the dense values' dot product with theirs


class _Buffers(threading.local):
    """Per-thread output and scratch space, grown on demand, with their addresses (reading an
    array's address costs more than the C call's own work on a short prompt)."""

    def __init__(self) -> None:
        self.cap = 0
        self.ints = np.zeros(4, dtype=np.int64)
        self.ints_at = self.ints.ctypes.data
        self.floats_for(1)

    def floats_for(self, n_weights: int) -> None:
        if getattr(self, "n_weights", 0) < n_weights:
            self.floats = np.zeros(17 + 4 * n_weights, dtype=np.float64)
            self.floats_at, self.n_weights = self.floats.ctypes.data, n_weights

    def grow(self, cols: int, work: int) -> None:
        cap = max(cols, work, 2 * self.cap, 4096)
        self.cols, self.work = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
        self.cols_at, self.work_at = self.cols.ctypes.data, self.work.ctypes.data
        self.cap = cap


class Kernel:
    """ctypes binding of `tokenyard_row` (ctypes releases the GIL during the call)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        fn = ctypes.CDLL(str(path)).tokenyard_row
        vp, i64, f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
        fn.argtypes = [ctypes.c_char_p, i64, ctypes.c_char_p, i64, ctypes.c_char_p, i64, vp, i64, vp, i64, i64,
                       f64, f64, f64, f64, f64, vp, vp, vp, i64, vp, vp, vp, vp]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._buf = _Buffers()

    def row(self, low: str, orig: str, text: str, tokens: int, left: list[int], sizes: list[int],
            tail_left: int, novelty: tuple[float, int], params: np.ndarray, norm_at: int,
            weights_at: int | None = None, n_weights: int = 1) -> NativeRow:
        """low: the window as its words are read (lower-cased); orig: as written; text: the whole
        prompt (its length and newlines); left/sizes: the cross block's crc32 entries, the last
        `tail_left` of left also alone; params/norm_at: `params_of` and the address of the dense
        mean then scale; weights_at: the address of float64 weights, n_weights per column (row-major),
        to sum per block."""
        lo = low.encode("utf-32-le", "surrogatepass")
        og = orig.encode("utf-32-le", "surrogatepass")
        n = len(lo) // 4
        # the newlines of an ASCII prompt are counted in C (memchr); str.count is a byte loop
        # (~12 us at 20k characters), still used for other text
        raw, lines = (text.encode("ascii"), 0) if text.isascii() else (None, text.count("\n") + 1)
        a, s = array("Q", left), array("Q", sizes)
        char_lo, char_hi = int(params[2]), int(params[3])
        cap = (3 + max(char_hi - char_lo, 0)) * (n + 2) + len(a) * (len(s) + 1) + len(s)
        b = self._buf
        if cap > b.cap or 3 * (n + 2) > b.cap:
            b.grow(cap, 3 * (n + 2))
        b.floats_for(n_weights)
        rc = self._fn(lo, n, og, len(og) // 4, raw, len(text), a.buffer_info()[0], len(a), s.buffer_info()[0],
                      len(s), tail_left, float(tokens), float(len(text)), float(lines), novelty[0],
                      float(novelty[1]), params.ctypes.data, norm_at, weights_at, n_weights, b.cols_at, b.work_at,
                      b.floats_at, b.ints_at)
        if rc != 0:
            raise MemoryError("router feature row: out of memory")
        e0, e1, e2, _ = b.ints.tolist()
        f = b.floats
        sums = None if weights_at is None else f[17:17 + 4 * n_weights].reshape(4, n_weights).copy()
        return NativeRow(b.cols[:e2].copy(), (e0, e1, e2), f[:14].copy(), f[14:17].copy(), sums)


def params_of(word_ngrams: tuple[int, int], char_ngrams: tuple[int, int], dims: tuple[int, int, int],
              starts: tuple[int, int, int], total: int, salts: tuple[int, int, int, int],
              cross_weight: float) -> np.ndarray:
    """The C function's parameter block (see native_row.c), built once per feature spec; the cross
    weight rides at the end as its float64 bits."""
    bits = int(np.array([cross_weight], dtype=np.float64).view(np.uint64)[0])
    return np.array([*word_ngrams, *char_ngrams, *dims, *starts, total, *salts, bits], dtype=np.uint64)


def load() -> Kernel | None:
    """The compiled kernel, built on first use; None (numpy path) when disabled or unavailable."""
    if not knobs.router_native():
        return None
    with _LOCK:
        if "kernel" not in _STATE:
            try:
                _STATE["kernel"] = Kernel(build())
            except (OSError, RuntimeError) as exc:
                log.warning("router features: the C row kernel is unavailable (%s); using the numpy path, "
                            "which gives the same scores ~3x slower", exc)
                _STATE["kernel"] = None
        return _STATE["kernel"]  # type: ignore[return-value]
