"""The prepared-weights cache: what a load computed from a checkpoint, kept on disk by content.

Why: a replica's start-up is mostly spent turning the checkpoint into the engine's forms (a GGUF's
metadata parsed, Q4_1 blocks repacked for torch's int4 op, then again for the C decode step), and
all of it is a pure function of the file, the engine options that shape the weights and this
machine's torch and CPU. Kept on disk, a second start maps the result instead of recomputing it
(bench/RESULTS.md, "Cold start, cut").

An entry is one file, `<kind>-<key>.safetensors`, in the safetensors layout (any safetensors reader
opens it; every tensor starts 64-byte aligned, padding being small `__pad__.N` tensors); the
header's metadata holds the key, a format version, the caller's JSON `meta` and a CRC-32 per 8 MiB
of the data. Loading maps the file copy-on-write (`mmap`, no read into fresh
memory: pages come from the page cache and are shared with other replicas until written), checks
size, key, version and every CRC (on two threads: zlib releases the GIL), and gives tensors that
view the mapping. Anything wrong (truncated, bit flips, another format, unreadable header) is
logged, the file is removed and the caller rebuilds: a bad entry never crashes a start and never
serves other weights. Entries are written to a temporary file and renamed into place, so
concurrent starts and a crash mid-write leave either nothing or a whole entry.

Keys (`make_key`) hash the format version, the caller's parts (source identity, options), torch's
version and the machine (architecture and CPU feature flags: torch's int4 packing and the C step's
layouts depend on them). `source_identity` names a checkpoint by content: per file its size,
modification time and the SHA-256 of sampled chunks (the first and last MiB and 16 spread 64 KiB
pieces: milliseconds, where hashing a whole 100 MB file takes 0.1 s of the start-up budget); a
rewritten file changes its mtime, so the key changes with it.

TOKENYARD_WEIGHT_CACHE=off disables the cache; TOKENYARD_WEIGHT_CACHE_DIR moves it (default
$XDG_CACHE_HOME/tokenyard/weights, ~/.cache/tokenyard/weights: beside the native builds). Nothing
evicts entries: delete the folder to reclaim the space (SmolLM2-135M int4: about 290 MB).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import platform
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenyard import knobs

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
CHUNK = 8 << 20                       # bytes per CRC-32 of the data
ALIGN = 64                            # every tensor's first byte, in the file and so in the mapping
_PAD = "__pad__."
_SAMPLE, _EDGE, _PIECES = 64 << 10, 1 << 20, 16
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in _DTYPES.items()}


class CorruptEntry(ValueError):
    """An entry that cannot be trusted (removed and rebuilt by the caller)."""


def cache_dir() -> Path | None:
    """The cache's folder, or None when TOKENYARD_WEIGHT_CACHE turns it off."""
    return Path(knobs.weight_cache_dir()) if knobs.weight_cache() else None


def _file_identity(path: Path) -> str:
    st = path.stat()
    return _sampled_hash(str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=64)
def _sampled_hash(path: str, size: int, mtime_ns: int, inode: int) -> str:
    h = hashlib.sha256(f"{size}\0{mtime_ns}\0".encode())
    with open(path, "rb") as f:
        if size <= 2 * _EDGE + _PIECES * _SAMPLE:
            h.update(f.read())
        else:
            spots = [0, size - _EDGE] + [_EDGE + i * (size - 2 * _EDGE) // _PIECES for i in range(_PIECES)]
            for at in spots:
                f.seek(at)
                h.update(f.read(_EDGE if at in (0, size - _EDGE) else _SAMPLE))
    return h.hexdigest()


def source_identity(path: str | Path) -> str:
    """A checkpoint's identity by content: one file, or every file of a folder (names included)."""
    p = Path(path)
    if p.is_file():
        return _file_identity(p)
    h = hashlib.sha256()
    for f in sorted(q for q in p.iterdir() if q.is_file()):
        h.update(f.name.encode() + b"\0" + _file_identity(f).encode() + b"\0")
    return h.hexdigest()


def _machine() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[-1].strip() for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {hashlib.sha256(flags.encode()).hexdigest()[:16]}"


def make_key(kind: str, parts: dict[str, Any]) -> str:
    """The entry key for `kind` and the caller's parts (JSON-able: source identity, options)."""
    doc = {"format": FORMAT_VERSION, "kind": kind, "parts": parts, "torch": torch.__version__, "machine": _machine()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def entry_path(kind: str, key: str) -> Path | None:
    d = cache_dir()
    return None if d is None else d / f"{kind}-{key[:40]}.safetensors"


@dataclass(slots=True)
class Entry:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


# ------------------------------------------------------------------ writing

def _byte_view(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def store(kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path | None:
    """Write an entry (atomically); None when the cache is off or the write failed (logged: a
    start-up must not fail for its cache)."""
    path = entry_path(kind, key)
    if path is None:
        return None
    try:
        return _write(path, kind, key, tensors, meta)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("prepared-weights cache: could not write %s (%s); the next start rebuilds it", path, exc)
        return None


def _write(path: Path, kind: str, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which the cache does not store")
    # Every tensor starts 64-byte aligned, as torch's own allocations do (packed CPU ops load
    # their weights with aligned vector instructions: a misaligned int8 weight crashed
    # _weight_int8pack_mm). safetensors allows no holes, so padding is a small U8 tensor of its own.
    header: dict[str, Any] = {}
    views, offset = [], 0
    for name in sorted(tensors):
        if name.startswith(_PAD):
            raise ValueError(f"tensor name {name!r} is reserved")
        if offset % ALIGN:
            gap = ALIGN - offset % ALIGN
            header[f"{_PAD}{len(header)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            views.append(memoryview(bytes(gap)))
            offset += gap
        t = tensors[name]
        view = _byte_view(t)
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(view)]}
        views.append(view)
        offset += len(view)
    crcs, crc, filled = [], 0, 0
    for view in views:                       # CRC-32 per CHUNK of the concatenated data
        at = 0
        while at < len(view):
            take = min(CHUNK - filled, len(view) - at)
            crc = zlib.crc32(view[at:at + take], crc)
            at, filled = at + take, filled + take
            if filled == CHUNK:
                crcs.append(crc)
                crc, filled = 0, 0
    if filled:
        crcs.append(crc)
    info = {"format": FORMAT_VERSION, "kind": kind, "key": key, "data_bytes": offset, "chunk": CHUNK,
            "crc32": crcs, "meta": meta}
    header["__metadata__"] = {"tokenyard": json.dumps(info, separators=(",", ":"))}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 64)      # data starts 64-byte aligned
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".write-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for view in views:
                f.write(view)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


# ------------------------------------------------------------------ reading

def load(kind: str, key: str) -> Entry | None:
    """The entry for (kind, key), checked; None when the cache is off, there is none, or it was
    bad (then it is removed, and the reason logged)."""
    path = entry_path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        return _read(path, kind, key)
    except (CorruptEntry, OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        _discard(path, exc)
        return None


def _discard(path: Path, why: Exception) -> None:
    """Remove an unusable entry (it is rebuilt by whoever asked for it), saying why."""
    log.warning("prepared-weights cache: %s is unusable (%s); rebuilding it", path, why)
    try:
        path.unlink()
    except OSError:
        pass


def _read(path: Path, kind: str, key: str) -> Entry:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CorruptEntry("shorter than its header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 64 << 20):
            raise CorruptEntry(f"header length {n} beyond the file ({size} bytes)")
        header = json.loads(f.read(n))
        info = json.loads(header.pop("__metadata__")["tokenyard"])
        if info.get("format") != FORMAT_VERSION or info.get("kind") != kind or info.get("key") != key:
            raise CorruptEntry(f"written for another format, kind or key ({info.get('format')}, {info.get('kind')})")
        start = 8 + n
        if start + int(info["data_bytes"]) != size:
            raise CorruptEntry(f"{size} bytes, the header says {start + int(info['data_bytes'])}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    data = memoryview(mm)[start:] if mm is not None else memoryview(b"")
    chunk = int(info["chunk"])
    spans = [(i, data[i * chunk:(i + 1) * chunk]) for i in range(len(info["crc32"]))]
    if sum(len(s) for _, s in spans) != len(data):
        raise CorruptEntry("CRC list does not cover the data")
    with ThreadPoolExecutor(2) as pool:                # zlib.crc32 releases the GIL on large buffers
        got = list(pool.map(lambda s: zlib.crc32(s[1]), spans))
    bad = [i for i, (a, b) in enumerate(zip(got, info["crc32"])) if a != b]
    if bad:
        raise CorruptEntry(f"CRC mismatch in {len(bad)} of {len(got)} chunk(s) (first at byte {bad[0] * chunk})")
    tensors: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        if name.startswith(_PAD):
            continue
        dtype = _BY_NAME[spec["dtype"]]
        b, e = spec["data_offsets"]
        shape = [int(d) for d in spec["shape"]]
        count = 1
        for d in shape:
            count *= d
        if not 0 <= b <= e <= len(data) or (e - b) != count * torch.empty(0, dtype=dtype).element_size():
            raise CorruptEntry(f"tensor {name}: offsets {b}..{e} do not fit its shape {shape}")
        if (start + b) % ALIGN:
            raise CorruptEntry(f"tensor {name} is not {ALIGN}-byte aligned")
        tensors[name] = (torch.frombuffer(mm, dtype=dtype, count=count, offset=start + b).reshape(shape)
                         if count else torch.empty(shape, dtype=dtype))
    return Entry(tensors, info["meta"], path)


# ------------------------------------------------------------------ small JSON entries

def load_json(kind: str, key: str) -> Any | None:
    """A small JSON entry (e.g. a GGUF file's config), or None; a bad one is removed."""
    path = entry_path(kind, key)
    if path is None or not path.with_suffix(".json").is_file():
        return None
    path = path.with_suffix(".json")
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT_VERSION or doc.get("key") != key:
            raise CorruptEntry("another format or key")
        return doc["value"]
    except (CorruptEntry, OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        _discard(path, exc)
        return None


def store_json(kind: str, key: str, value: Any) -> None:
    path = entry_path(kind, key)
    if path is None:
        return
    path = path.with_suffix(".json")
    tmp = None
    try:
        text = json.dumps({"format": FORMAT_VERSION, "key": key, "value": value})
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".write-", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except (OSError, ValueError, TypeError) as exc:
        log.warning("prepared-weights cache: could not write %s (%s)", path, exc)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
