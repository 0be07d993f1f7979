"""The local append-only spool: usage records wait here while Redis is unreachable.

Layout: `{spool_dir}/{target}/` where target is a hash of (redis_url, redis_prefix), so records
are only ever replayed into the Redis and prefix they were meant for, even when several gateways
(or test runs) share a spool_dir.

    spool.jsonl              records being appended (one JSON object per line)
    replay-{ns}-{pid}.jsonl  a batch claimed for replay (renamed from spool.jsonl, atomically)
    .replay.lock             flock held by whichever process replays, so two never replay at once
    .append.lock             flock held around each append and around the claim's rename, so no
                             append can land in a file after it was claimed (and then be lost)

Appends write whole lines in one write() call under the append lock. fsync policy (`spend.spool_fsync`):
"always" fsyncs the file after every append (a batch of records: whatever ended while the
previous write was in progress), so a record the gateway has spooled survives a power cut;
"never" leaves flushing to the OS (survives a gateway crash, not a machine crash).

Replay is safe to repeat: the ledger's Lua script ignores a request id it has already recorded,
so a claimed file that was replayed in part (Redis dropped again midway) is simply replayed again
in full next time, and the file is deleted only after every line went through. A torn last line
(the process died mid-write) is skipped and logged, never fatal.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("tokenyard.spend")


class SpendSpool:
    def __init__(self, root: Path, redis_url: str, prefix: str, fsync: bool = True) -> None:
        target = hashlib.sha256(f"{redis_url}\0{prefix}".encode()).hexdigest()[:16]
        self.dir = Path(root) / target
        self.fsync = fsync
        self.live = self.dir / "spool.jsonl"

    def append(self, records: list[dict[str, Any]]) -> None:
        """Blocking (file I/O + fsync): the ledger calls it from a worker thread."""
        if not records:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        with _Lock(self.dir / ".append.lock", blocking=True):
            fd = os.open(self.live, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

    def pending(self) -> bool:
        """Anything waiting (live or claimed files)."""
        if not self.dir.is_dir():
            return False
        return self.live.exists() or any(self.dir.glob("replay-*.jsonl"))

    def claim(self) -> list[Path]:
        """Move the live file aside (new appends start a new one); return every claimed file, oldest first."""
        if not self.dir.is_dir():
            return []
        with _Lock(self.dir / ".append.lock", blocking=True):
            if self.live.exists():
                os.replace(self.live, self.dir / f"replay-{time.time_ns()}-{os.getpid()}.jsonl")
        return sorted(self.dir.glob("replay-*.jsonl"))

    def lock(self) -> "_Lock":
        return _Lock(self.dir / ".replay.lock")

    @staticmethod
    def read(path: Path) -> Iterator[dict[str, Any]]:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    log.error("spool %s line %d is not a record (torn write?); skipped", path, n)

    @staticmethod
    def done(path: Path) -> None:
        path.unlink(missing_ok=True)
        # The directory entry must be durable too, or a crash could resurrect a replayed file
        # (harmless, since replays are idempotent, but wasted work).
        try:
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass


class _Lock:
    """Exclusive flock. Non-blocking by default: `with spool.lock() as held: if held: ...`."""

    def __init__(self, path: Path, blocking: bool = False) -> None:
        self.path = path
        self.blocking = blocking
        self.fd: int | None = None

    def __enter__(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
            return True
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            return False

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None
