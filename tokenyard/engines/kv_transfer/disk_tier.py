"""The disk tier: KV blocks as content-addressed files, kept across restarts, shared by replicas.

    <root>/<layout fingerprint>/<block digest hex>.kvb
    file = magic "TYKVBLK1" | digest (16 bytes) | u64 length | u32 CRC-32 | block bytes

The name is the block's stable digest (prefix_digest.py) under the folder of its model and cache
layout (layout.py), so any replica of the same model and layout on the host finds the blocks any
other wrote, and a replica of another model never reads them. Writes go to a temporary file in the
same folder and are renamed over the name (atomic on POSIX): a reader sees a whole file or none,
and two replicas writing the same block write the same bytes. A read checks magic, digest, length
and CRC; a file that fails is deleted and counts as a miss (the prefix is recomputed).

The bound: used bytes are counted from a scan at start-up plus this process's writes; past the
bound the folder is scanned again (other replicas write too) and the least recently used files
(modification time: a read touches it) are deleted down to 90% of it. Files another replica
deletes meanwhile are simply misses. Writes happen on the engine's step thread when a block is
evicted past the host tier; no fsync (a file cut short by a crash fails its CRC).
"""
from __future__ import annotations

import os
import struct
import tempfile
import time
from pathlib import Path

from tokenyard.engines.core.prefix_digest import DIGEST_SIZE
from tokenyard.engines.kv_transfer.block_payload import BlockRecord, crc32

MAGIC = b"TYKVBLK1"
_HEAD = struct.Struct(f"<8s{DIGEST_SIZE}sQI")
SUFFIX = ".kvb"
STALE_TMP_S = 3600.0     # a temporary file this old is a crashed writer's: deleted by a trim


class DiskTier:
    def __init__(self, root: str | Path, fingerprint: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be > 0 bytes, got {capacity_bytes}")
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.used_bytes = sum(size for _, size, _ in self._scan())
        self.num_writes = 0
        self.num_hits = 0
        self.num_corrupt = 0
        self.num_deleted = 0

    def path(self, digest: bytes) -> Path:
        return self.dir / f"{digest.hex()}{SUFFIX}"

    def put(self, rec: BlockRecord) -> None:
        path = self.path(rec.digest)
        try:
            os.utime(path)           # already there (this replica or another): most recent now
            return
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=SUFFIX, dir=self.dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEAD.pack(MAGIC, rec.digest, len(rec.data), rec.checksum()))
                f.write(rec.data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        self.num_writes += 1
        self.used_bytes += _HEAD.size + len(rec.data)
        if self.used_bytes > self.capacity_bytes:
            self.trim()

    def get(self, digest: bytes) -> BlockRecord | None:
        path = self.path(digest)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        ok = len(raw) >= _HEAD.size
        if ok:
            magic, d, n, crc = _HEAD.unpack_from(raw)
            data = raw[_HEAD.size:]
            ok = magic == MAGIC and d == digest and n == len(data) and crc32(data) == crc
        if not ok:
            self.num_corrupt += 1
            self._delete(path)
            return None
        try:
            os.utime(path)
        except FileNotFoundError:
            pass
        self.num_hits += 1
        return BlockRecord(digest, data, crc)

    def trim(self) -> None:
        """Delete least recently used files until the folder holds <= 90% of the bound."""
        files = sorted(self._scan(), key=lambda f: f[2])
        used = sum(size for _, size, _ in files)
        target = int(self.capacity_bytes * 0.9)
        for path, size, _ in files:
            if used <= target:
                break
            if self._delete(path):
                used -= size
        self.used_bytes = used

    def _scan(self) -> list[tuple[Path, int, float]]:
        out = []
        now = time.time()
        with os.scandir(self.dir) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.startswith(".tmp-"):
                    if now - st.st_mtime > STALE_TMP_S:
                        self._delete(Path(e.path))
                    continue
                if e.name.endswith(SUFFIX):
                    out.append((Path(e.path), st.st_size, st.st_mtime))
        return out

    def _delete(self, path: Path) -> bool:
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        self.num_deleted += 1
        return True
