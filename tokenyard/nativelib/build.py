"""One C source compiled into a shared library, once per source, flags and compiler, cached on disk.

    from tokenyard.nativelib.build import cached_library
    path = cached_library(SOURCE, ("-O2", "-shared", "-fPIC"), "router_row")   # then ctypes.CDLL(path)

Used by the router's feature row (tokenyard/router_models/runtime/native.py) and the CPU decode attention
(tokenyard/kernels/cpu_decode_native.py); both keep a pure-Python/torch path for machines without a compiler.
Standard library only, so every layer may import it (the GPU box runs kernels/ from PYTHONPATH).

The compiler is $CC, else cc, gcc or clang on PATH. Libraries live in
$XDG_CACHE_HOME/tokenyard/native (default ~/.cache/tokenyard/native), named by a hash of the
source, the flags, the compiler, the machine and its CPU's feature flags; a build goes to a temporary file first and is
renamed into place, so concurrent processes and restarts share one build.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, TypeVar

_log = logging.getLogger(__name__)
T = TypeVar("T")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenyard" / "native"


def compiler() -> str | None:
    """The C compiler to use, or None when the machine has none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), so a -march=native build is never reused on another CPU."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[-1].strip()
    except OSError:
        pass
    return platform.processor()


def cached_library(source: Path, flags: tuple[str, ...], name: str, out_dir: Path | None = None,
                   cc: str | None = None, includes: tuple[Path, ...] = ()) -> Path:
    """The library built from `source` with `flags` (compiled now if there is no such build yet);
    RuntimeError when there is no compiler or the build fails (with the compiler's last words).
    `includes`: files the source #includes, hashed into the name so that an edit to one rebuilds."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler on PATH (set CC, or install gcc)")
    digest = hashlib.sha256(source.read_bytes())
    for extra in includes:
        digest.update(extra.read_bytes())
    for part in (*flags, cc, platform.machine(), _cpu_features()):
        digest.update(part.encode() + b"\0")
    target = (out_dir or cache_dir()) / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cc} could not build {source.name}: {done.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    except subprocess.SubprocessError as exc:
        raise RuntimeError(f"{cc} could not build {source.name}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


def load_once(loaded: dict[str, T | None], lock: threading.Lock, key: str, build: Callable[[], T],
              what: str) -> T | None:
    """loaded[key], built by `build` on first use; None (after one warning naming `what`) when the build
    or the library load fails, so the caller's torch forms serve. `loaded` and `lock` are the caller's."""
    with lock:
        if key not in loaded:
            try:
                loaded[key] = build()
            except (OSError, RuntimeError) as exc:
                _log.warning("%s: the C kernel is unavailable (%s); the torch forms serve", what, exc)
                loaded[key] = None
        return loaded[key]
