"""The host-memory tier: KV blocks evicted from the engine's pool, kept in RAM up to a byte bound.

Least recently used first out: a block pushed past the bound goes to `spill` (the disk tier) or,
without one, is dropped. A read checks the block's CRC (a flipped bit in RAM costs a recompute,
never a wrong token) and makes it most recently used.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tokenyard.engines.kv_transfer.block_payload import BlockRecord


class HostTier:
    def __init__(self, capacity_bytes: int, spill: Callable[[BlockRecord], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.spill = spill
        self._blocks: OrderedDict[bytes, BlockRecord] = OrderedDict()
        self.used_bytes = 0
        self.num_hits = 0
        self.num_spilled = 0
        self.num_dropped = 0
        self.num_corrupt = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._blocks

    def put(self, rec: BlockRecord) -> None:
        if rec.digest in self._blocks:
            self._blocks.move_to_end(rec.digest)
            return
        if len(rec.data) > self.capacity_bytes:
            self._out(rec)
            return
        self._blocks[rec.digest] = rec
        self.used_bytes += len(rec.data)
        while self.used_bytes > self.capacity_bytes:
            _, old = self._blocks.popitem(last=False)
            self.used_bytes -= len(old.data)
            self._out(old)

    def get(self, digest: bytes) -> BlockRecord | None:
        rec = self._blocks.get(digest)
        if rec is None:
            return None
        if not rec.intact():
            del self._blocks[digest]
            self.used_bytes -= len(rec.data)
            self.num_corrupt += 1
            return None
        self._blocks.move_to_end(digest)
        self.num_hits += 1
        return rec

    def drain(self) -> None:
        """Hand every block to spill (most recent last), e.g. before the process exits."""
        while self._blocks:
            _, rec = self._blocks.popitem(last=False)
            self.used_bytes -= len(rec.data)
            self._out(rec)

    def _out(self, rec: BlockRecord) -> None:
        if self.spill is not None:
            self.spill(rec)
            self.num_spilled += 1
        else:
            self.num_dropped += 1
