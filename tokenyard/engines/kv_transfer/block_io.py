"""Copy whole KV blocks between an engine's cache tensors and flat bytes.

A block's bytes are, layer by layer, K then V, each as [kv head, slot in block, head dim] in the
cache's storage dtype, with a quantised cache's fp32 scales [kv head, slot in block] after its
codes. The same order on every engine of one KVLayout, so bytes move between them as they are.
Reads and writes go through index_select / index_copy_ on byte views of the caches: the tensors
are updated in place, so every path that holds them (the C decode step, compiled graphs, CUDA
graphs) sees the blocks without a rebuild.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from tokenyard.kernels.kv_quant import QuantizedCache


class BlockIO:
    def __init__(self, kv_caches: list, block_size: int) -> None:
        self.block_size = block_size
        # Every tensor a block has a slice of, in the byte order above; slots are dimension 1.
        self.parts: list[torch.Tensor] = []
        for k, v in kv_caches:
            for cache in (k, v):
                if isinstance(cache, QuantizedCache):
                    self.parts += [cache.bytes_view, cache.scale]
                else:
                    self.parts.append(cache)
        self.device = self.parts[0].device
        # Bytes of one block in each part: heads x block_size x (head dim or 1) x element size.
        self.part_bytes = [p.shape[0] * block_size * math.prod(p.shape[2:]) * p.element_size() for p in self.parts]
        self.block_nbytes = sum(self.part_bytes)

    def _ids(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.long, device=self.device)

    def _by_block(self, p: torch.Tensor) -> torch.Tensor:
        """A part as [heads, blocks, the block's values of one head] (a view, no copy)."""
        return p.view(p.shape[0], p.shape[1] // self.block_size, -1)

    def read(self, blocks: list[int]):
        """The bytes of each block, in order: rows of one uint8 array (numpy), one copy out of the
        cache and one into the array. The rows share the array's memory; it is freed with the
        last row (a host tier holding one block of a batch keeps the batch's memory)."""
        n = len(blocks)
        if n == 0:
            return []
        out = torch.empty(n, self.block_nbytes, dtype=torch.uint8)
        ids = self._ids(blocks)
        off = 0
        for p, width in zip(self.parts, self.part_bytes):
            sel = self._by_block(p).index_select(1, ids)                       # [H, n, X]
            dst = out[:, off:off + width].view(p.dtype).view(n, p.shape[0], -1)
            dst.copy_(sel.transpose(0, 1))
            off += width
        arr = out.numpy()
        return [arr[i] for i in range(n)]

    def write(self, blocks: list[int], datas: list) -> None:
        """Overwrite each block with its bytes (each exactly block_nbytes long, any buffer)."""
        if len(blocks) != len(datas):
            raise ValueError(f"{len(blocks)} blocks but {len(datas)} byte strings")
        if not blocks:
            return
        n = len(blocks)
        flat = torch.empty(n, self.block_nbytes, dtype=torch.uint8)
        arr = flat.numpy()
        for i, d in enumerate(datas):
            row = np.frombuffer(d, dtype=np.uint8)
            if row.size != self.block_nbytes:
                raise ValueError(f"a KV block is {self.block_nbytes} bytes here, got {row.size}")
            arr[i] = row
        ids = self._ids(blocks)
        off = 0
        for p, width in zip(self.parts, self.part_bytes):
            src = flat[:, off:off + width].view(p.dtype).view(n, p.shape[0], -1).transpose(0, 1)
            self._by_block(p).index_copy_(1, ids, src.to(self.device))
            off += width
