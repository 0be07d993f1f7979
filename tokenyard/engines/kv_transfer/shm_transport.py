"""KV payloads between processes on one host, through shared memory (files in /dev/shm).

The sender writes the payload as one frame (frames.py) to a temporary file in a tmpfs folder and
renames it to a random handle; it passes the handle to the receiver by whatever channel the two
already share (the request message), and the receiver reads the file, unlinks it and checks the
frame. tmpfs pages are RAM: the copy costs one memcpy each way, no socket. A handle the receiver
never takes stays until `sweep` (run it at start-up) deletes it after max_age_s.
"""
from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from pathlib import Path

from tokenyard.engines.kv_transfer.block_payload import BlockPayload
from tokenyard.engines.kv_transfer.frames import FrameError, decode_frame, encode_frame

_HANDLE = re.compile(r"[0-9a-f]{32}")
SUFFIX = ".kvframe"


def default_dir() -> Path:
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "tokenyard-kv"


class ShmTransport:
    def __init__(self, directory: str | Path | None = None) -> None:
        self.dir = Path(directory) if directory is not None else default_dir()
        self.dir.mkdir(parents=True, exist_ok=True)

    def send(self, payload: BlockPayload | bytes) -> str:
        """Publish a payload; returns its handle (32 hex digits)."""
        body = payload.to_bytes() if isinstance(payload, BlockPayload) else payload
        handle = uuid.uuid4().hex
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(encode_frame(body))
            os.replace(tmp, self.dir / f"{handle}{SUFFIX}")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return handle

    def receive_bytes(self, handle: str, timeout_s: float = 10.0) -> bytes:
        """The payload bytes behind a handle (waiting up to timeout_s for it to appear); the file
        is removed whether or not its frame checks out. FrameError or TimeoutError otherwise."""
        if not isinstance(handle, str) or not _HANDLE.fullmatch(handle):
            raise FrameError(f"not a KV transfer handle: {handle!r}")
        path = self.dir / f"{handle}{SUFFIX}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                raw = path.read_bytes()
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"KV payload {handle} did not arrive within {timeout_s:g} s") from None
                time.sleep(0.005)
        path.unlink(missing_ok=True)
        return decode_frame(raw)

    def receive(self, handle: str, timeout_s: float = 10.0) -> BlockPayload:
        return BlockPayload.from_bytes(self.receive_bytes(handle, timeout_s))

    def sweep(self, max_age_s: float = 600.0) -> int:
        """Delete payloads (and temporary files) older than max_age_s; returns how many."""
        n, now = 0, time.time()
        for p in self.dir.iterdir():
            try:
                if now - p.stat().st_mtime > max_age_s:
                    p.unlink()
                    n += 1
            except FileNotFoundError:
                continue
        return n
