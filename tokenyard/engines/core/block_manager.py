"""Per-sequence KV block tables on top of the BlockPool, with prefix caching.

A sequence's block table always covers exactly the slots it needs: blocks are added just ahead
of use (`grow`), dropped from the tail on rollback (`truncate`), and all released at the end
(`free`, tail first, so the deepest blocks of a chain are evicted before the shared roots).

The hash chain: block i of a sequence is keyed by (block i-1's id, its token ids); block 0 by
(("salt", cache_salt), its token ids). A tenant's salt therefore keeps its cache private.
chain_root() is the one place that names a chain's root: whatever else must keep prefixes apart
goes there, and the stable digests of blocks that leave the engine (prefix_digest.py) follow.

prefix_loader, when set (the second cache tier, tokenyard/engines/kv_transfer/tiered_store.py), is
asked to extend a prefix hit that stops short of the prompt's cacheable blocks: it puts blocks it
holds back into the pool, registered, and appends them to the hit.

A sequence run with a LoRA adapter (lora_id > 0) roots its chain at ("salt", cache_salt, lora_id): its
KV depends on the adapter's weights, so no block is ever shared across adapters or with the base.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenyard.engines.core.block_pool import BlockPool
from tokenyard.engines.core.sequence import Sequence

# What a block's cache key names as its parent: the previous block's id, or for a first block the
# ("salt", cache_salt) marker that keeps one tenant's prefixes apart from another's (with the LoRA
# adapter's id appended for an adapter's sequences).
Parent = int | tuple[str, str | None] | tuple[str, str | None, int]


def chain_root(seq: Sequence) -> tuple[int, Parent]:
    """The (parent hash, parent key) a sequence's first block is cached under."""
    if seq.lora_id:
        return hash(("tokenyard-prefix", seq.cache_salt, seq.lora_id)), ("salt", seq.cache_salt, seq.lora_id)
    return hash(("tokenyard-prefix", seq.cache_salt)), ("salt", seq.cache_salt)


@dataclass(slots=True)
class PrefixHit:
    blocks: list[int]
    hashes: list[int]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.prefix_loader: Callable[[Sequence, PrefixHit], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- growth and release -------------------------------------------------------------------
    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return max(0, self.blocks_needed(num_tokens) - len(block_table)) + reserve <= self.pool.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks so the table holds `num_tokens` slots. Caller checked can_grow."""
        extra = self.blocks_needed(num_tokens) - len(block_table)
        if extra > 0:
            block_table.extend(self.pool.allocate(extra))

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the blocks past `num_tokens` slots (speculative rollback keeps the rest)."""
        keep = self.blocks_needed(num_tokens)
        if keep < len(seq.block_table):
            dropped = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.pool.release(dropped[::-1])
        del seq.block_hashes[num_tokens // self.block_size:]

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table[::-1])
        seq.block_table.clear()
        seq.block_hashes.clear()

    # -- prefix caching -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> PrefixHit:
        """The cached blocks that start this sequence. At least one token is always left to
        compute (its logits are needed), so a fully cached prompt recomputes its last block."""
        hit = PrefixHit([], [])
        if not self.enable_prefix_caching:
            return hit
        bs = self.block_size
        parent_hash, parent = self.chain_root(seq)
        cacheable = (seq.num_tokens - 1) // bs
        for i in range(cacheable):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = hash((parent_hash, tokens))
            b = self.pool.lookup(h, (parent, tokens))
            if b is None:
                break
            hit.blocks.append(b)
            hit.hashes.append(h)
            parent_hash, parent = h, b
        if self.prefix_loader is not None and len(hit.blocks) < cacheable:
            self.prefix_loader(seq, hit)
        return hit

    @staticmethod
    def chain_root(seq: Sequence) -> tuple[int, Parent]:
        """(hash, parent) that a sequence's first block chains from (the module's chain_root)."""
        return chain_root(seq)

    def can_admit(self, seq: Sequence, hit: PrefixHit, reserve: int) -> bool:
        """Room for the whole uncached prompt plus `reserve` free blocks to spare."""
        free_hits = sum(1 for b in hit.blocks if self.pool.is_free(b))
        need = self.blocks_needed(seq.num_tokens) - len(hit.blocks)
        return need + reserve <= self.pool.num_free - free_hits

    def adopt(self, seq: Sequence, hit: PrefixHit) -> None:
        """Give an admitted sequence its cached prefix: those tokens need no compute."""
        for b in hit.blocks:
            self.pool.touch(b)
        seq.block_table[:] = hit.blocks
        seq.block_hashes[:] = hit.hashes
        seq.num_computed_tokens = len(hit.blocks) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.queried_tokens += seq.num_prompt_tokens
            self.hit_tokens += seq.num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed (full, computed) blocks."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        parent: Parent
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if i:
                parent_hash, parent = seq.block_hashes[i - 1], seq.block_table[i - 1]
            else:
                parent_hash, parent = self.chain_root(seq)
            h = hash((parent_hash, tokens))
            self.pool.register(seq.block_table[i], h, (parent, tokens))
            seq.block_hashes.append(h)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
