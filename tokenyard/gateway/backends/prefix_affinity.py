"""Prefix affinity: which replica probably holds a prompt's leading KV blocks in its prefix cache.

The engine caches full blocks keyed by a hash chain (block i by block i-1 and its tokens; block
0 by the tenant's cache salt), so two prompts share cached KV exactly as far as they share
whole leading blocks. The gateway mirrors that chain over the first `max_blocks` blocks of a
prompt (same block size as the engine, same salt) and remembers, per replica, the chain hashes
of prompts it recently sent there, in an LRU of bounded size. The index is approximate on
purpose: it never asks the replica what it really holds (a replica may have evicted a block, or
restarted), it only knows where similar prompts went; that is enough to keep a prefix on one
replica, and a wrong guess costs a recomputed prefill, never a wrong answer.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def prefix_hashes(token_ids: list[int], block_size: int, max_blocks: int, salt: str | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full leading blocks (at most max_blocks of them)."""
    n = min(len(token_ids) // block_size, max_blocks)
    out: list[bytes] = []
    parent = hashlib.blake2b(("salt:" + (salt or "")).encode(), digest_size=16).digest()
    for i in range(n):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


class AffinityIndex:
    """Recently routed prefix hashes of one replica, least recently used evicted first."""

    __slots__ = ("capacity", "_lru")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: list[bytes]) -> int:
        """How many leading blocks of the chain this replica was sent before."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def record(self, hashes: list[bytes]) -> None:
        lru = self._lru
        for h in reversed(hashes):      # roots last: most recent, so evicted after the deep blocks
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def clear(self) -> None:
        self._lru.clear()
