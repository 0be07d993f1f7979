"""Fixed-size KV blocks with reference counts and a free list.

A block holds `block_size` token slots in every layer's K and V cache. Sequences own blocks
through their block tables; a block returns to the free list when its last owner lets go.
Reference counts (rather than single ownership) are what prefix caching builds on: a cached
block can be shared by several sequences (issue 5).
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks at zero go back to the free list."""
        for b in blocks:
            count = self.ref_counts[b]
            if count <= 0:
                raise RuntimeError(f"KV block {b} released more times than it was taken")
            self.ref_counts[b] = count - 1
            if count == 1:
                self._free.append(b)


class BlockManager:
    """Keeps each sequence's block table sized to the tokens it must hold."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_needed(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int, reserve: int = 0) -> bool:
        return self.extra_blocks(block_table, num_tokens) + reserve <= self.pool.num_free

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append blocks so the table holds `num_tokens` slots. Caller checked can_grow."""
        extra = self.extra_blocks(block_table, num_tokens)
        if extra:
            block_table.extend(self.pool.allocate(extra))

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Drop the blocks past `num_tokens` slots (speculative rollback keeps the rest)."""
        keep = self.blocks_needed(num_tokens)
        if keep < len(block_table):
            dropped = block_table[keep:]
            del block_table[keep:]
            self.pool.release(dropped)

    def free(self, block_table: list[int]) -> None:
        self.pool.release(block_table)
        block_table.clear()
