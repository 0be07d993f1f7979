"""Fixed-size KV blocks: reference counts, an LRU free list, and the prefix-cache registry.

A block holds `block_size` token slots in every layer's K and V cache. Sequences hold blocks
through their block tables; a block returns to the free list when its last holder lets go.

Prefix caching: a full, computed block is registered under a key that names its exact content
— the block that precedes it (or the cache salt, for a first block) and its token ids — and
under a hash of that chain for fast lookup. A released block keeps its registration while it
sits in the free list, so a later request with the same prefix can take it back; blocks are
reused least recently released first, and reuse evicts the registration. Lookups compare the
full key, never just the hash, so a hash collision can only miss, never return wrong KV.

Each registered block also gets a stable digest (prefix_digest.py: the name its KV carries outside
this process), and `on_evict`, when set, is called with the (block, digest) pairs a call to
allocate() is about to reuse, while their KV is still intact: the second cache tier
(tokenyard/engines/kv_transfer/tiered_store.py) copies them out there.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Hashable

from tokenyard.engines.core.prefix_digest import block_digest, root_digest


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        self._key_of: list[Hashable | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._digest_of: list[bytes | None] = [None] * num_blocks
        self.num_evictions = 0
        self.on_evict: Callable[[list[tuple[int, bytes]]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        evicted: list[tuple[int, bytes]] = []
        on_evict = self.on_evict
        for _ in range(n):
            b, _ = self._free.popitem(last=False)   # least recently released first
            digest = self._digest_of[b]
            if self._forget(b) and digest is not None and on_evict is not None:
                evicted.append((b, digest))
            self._digest_of[b] = None
            self.ref_counts[b] = 1
            blocks.append(b)
        if evicted and on_evict is not None:
            on_evict(evicted)
        return blocks

    def touch(self, block: int) -> None:
        """Take one more reference to a block found in the prefix cache."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks at zero join the free list (most recent last)."""
        for b in blocks:
            count = self.ref_counts[b]
            if count <= 0:
                raise RuntimeError(f"KV block {b} released more times than it was taken")
            self.ref_counts[b] = count - 1
            if count == 1:
                self._free[b] = None

    def register(self, block: int, block_hash: int, key: Hashable) -> None:
        """Make a full, computed block findable. A hash already taken keeps its first block."""
        if self._digest_of[block] is None and isinstance(key, tuple) and len(key) == 2:
            # The block manager's key is (parent block, tokens) or (chain root, tokens): the parent's
            # digest is set, as the same sequence holds the parent (registered or not: a taken hash
            # still chains). Other keys (tests of the pool alone) get no digest.
            parent, tokens = key
            parent_digest = self._digest_of[parent] if isinstance(parent, int) else root_digest(parent)
            if parent_digest is not None:
                self._digest_of[block] = block_digest(parent_digest, tokens)
        if block_hash in self._by_hash or self._hash_of[block] is not None:
            return
        self._by_hash[block_hash] = block
        self._hash_of[block] = block_hash
        self._key_of[block] = key

    def lookup(self, block_hash: int, key: Hashable) -> int | None:
        b = self._by_hash.get(block_hash)
        if b is None or self._key_of[b] != key:
            return None
        return b

    def digest(self, block: int) -> bytes | None:
        """The stable digest of a full block's content (None for a block never registered)."""
        return self._digest_of[block]

    def cached_blocks(self) -> list[tuple[int, bytes]]:
        """(block, digest) of every block registered in the prefix cache, held or free."""
        return [(b, d) for b, d in enumerate(self._digest_of) if d is not None and self._hash_of[b] is not None]

    def _forget(self, block: int) -> bool:
        """Drop a block's registration; True when it had one (an eviction)."""
        h = self._hash_of[block]
        if h is None:
            return False
        del self._by_hash[h]
        self._hash_of[block] = None
        self._key_of[block] = None
        self.num_evictions += 1
        return True
