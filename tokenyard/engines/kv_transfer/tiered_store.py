"""The second cache tier, attached to one engine: evicted prefix blocks go to host memory, then to
local disk, and come back on a prefix hit instead of being recomputed.

Two hooks into the engine core, nothing else:
- BlockPool.on_evict: when allocate() reuses cached free blocks, their KV (still intact) is read
  out (BlockIO) and put in the host tier under the block's stable digest; the host tier's least
  recently used blocks spill to the disk tier (host_tier.py, disk_tier.py).
- BlockManager.prefix_loader: when an admission's prefix hit stops before the prompt's last
  cacheable block, the digests of the following blocks are looked up, host tier first, then disk;
  the run found (up to the free blocks) is written back into the pool and registered
  (connector.install_blocks), and the hit grows by it. The first miss or corrupt block ends it.

Restored blocks come back exactly as they were written (the same bytes, scales included for int8),
so the tokens after a tier hit equal those after a pool hit. close() writes the pool's cached blocks
and the host tier to disk (when there is a disk tier), so a restarted replica finds them all.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenyard.engines.core.block_manager import PrefixHit
from tokenyard.engines.core.prefix_digest import chain_digests
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.kv_transfer.block_payload import BlockRecord
from tokenyard.engines.kv_transfer.connector import engine_block_io, engine_layout, install_blocks
from tokenyard.engines.kv_transfer.disk_tier import DiskTier
from tokenyard.engines.kv_transfer.host_tier import HostTier

# The engine is typed loosely: runtime sits above this package (it builds the tier) and is not imported.
Engine = Any


class TieredStore:
    def __init__(self, engine: Engine, host_bytes: int, disk_path: str | Path | None, disk_bytes: int) -> None:
        self.blocks = engine.blocks
        self.io = engine_block_io(engine)
        self.layout = engine_layout(engine)
        self.disk = DiskTier(disk_path, self.layout.fingerprint, disk_bytes) if disk_path else None
        self.host = HostTier(host_bytes, spill=self.disk.put if self.disk is not None else None)
        self.num_offloaded = 0       # blocks read out of the pool on eviction
        self.num_restored = 0        # blocks written back into the pool on a prefix hit
        self.blocks.pool.on_evict = self.on_evict
        self.blocks.prefix_loader = self.load

    def on_evict(self, evicted: list[tuple[int, bytes]]) -> None:
        fresh = [(b, d) for b, d in evicted if d not in self.host]
        for (_, digest), data in zip(fresh, self.io.read([b for b, _ in fresh])):
            self.host.put(BlockRecord(digest, data, None))
        self.num_offloaded += len(fresh)

    def load(self, seq: Sequence, hit: PrefixHit) -> None:
        bs = self.blocks.block_size
        k = len(hit.blocks)
        cacheable = (seq.num_tokens - 1) // bs
        pool = self.blocks.pool
        room = pool.num_free - sum(1 for b in hit.blocks if pool.is_free(b))
        if room <= 0:
            return
        digests = chain_digests(self.blocks.chain_root(seq)[1], seq.token_ids, bs, cacheable)[k:k + room]
        datas = []
        for d in digests:
            rec = self.host.get(d)
            if rec is None and self.disk is not None:
                rec = self.disk.get(d)
            if rec is None:
                break
            datas.append(rec.data)
        if datas:
            self.num_restored += install_blocks(self.blocks, self.io, seq, hit, datas)

    def close(self, flush: bool = True) -> None:
        """Detach from the engine; with a disk tier and flush, the pool's cached blocks and the host
        tier's go to disk first (the host tier's oldest first, the pool's last: the most recent)."""
        if self.disk is not None and flush:
            self.host.drain()
            cached = self.blocks.pool.cached_blocks()
            for i in range(0, len(cached), 64):
                part = cached[i:i + 64]
                for (_, digest), data in zip(part, self.io.read([b for b, _ in part])):
                    self.disk.put(BlockRecord.of(digest, data))
        if self.blocks.pool.on_evict == self.on_evict:
            self.blocks.pool.on_evict = None
        if self.blocks.prefix_loader == self.load:
            self.blocks.prefix_loader = None

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "offloaded_blocks": self.num_offloaded, "restored_blocks": self.num_restored,
            "host_blocks": len(self.host), "host_bytes": self.host.used_bytes, "host_hits": self.host.num_hits,
            "host_spilled": self.host.num_spilled, "host_dropped": self.host.num_dropped,
            "host_corrupt": self.host.num_corrupt}
        if self.disk is not None:
            out.update(disk_bytes=self.disk.used_bytes, disk_writes=self.disk.num_writes, disk_hits=self.disk.num_hits,
                       disk_corrupt=self.disk.num_corrupt, disk_deleted=self.disk.num_deleted)
        return out
