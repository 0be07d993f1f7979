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

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        base = torch.tensor(blocks, dtype=torch.long)[:, None] * self.block_size
        return (base + torch.arange(self.block_size)).reshape(-1).to(self.device)

    def read(self, blocks: list[int]) -> list[bytes]:
        """The bytes of each block, in order."""
        if not blocks:
            return []
        n, slots = len(blocks), self._slots(blocks)
        cols = []
        for p in self.parts:
            t = p.index_select(1, slots)                                   # [H, n*bs, ...]
            t = t.reshape(p.shape[0], n, -1).transpose(0, 1).contiguous()  # [n, H, bs*...]
            cols.append(t.reshape(n, -1).view(torch.uint8))
        flat = torch.cat(cols, dim=1).cpu().numpy()
        return [flat[i].tobytes() for i in range(n)]

    def write(self, blocks: list[int], datas: list[bytes]) -> None:
        """Overwrite each block with its bytes (each exactly block_nbytes long)."""
        if len(blocks) != len(datas):
            raise ValueError(f"{len(blocks)} blocks but {len(datas)} byte strings")
        if not blocks:
            return
        for d in datas:
            if len(d) != self.block_nbytes:
                raise ValueError(f"a KV block is {self.block_nbytes} bytes here, got {len(d)}")
        n, slots = len(blocks), self._slots(blocks)
        flat = torch.frombuffer(bytearray(b"".join(datas)), dtype=torch.uint8).view(n, self.block_nbytes)
        off = 0
        for p, width in zip(self.parts, self.part_bytes):
            t = flat[:, off:off + width].contiguous().view(p.dtype)           # [n, H*bs*...]
            t = t.view(n, p.shape[0], self.block_size, *p.shape[2:]).transpose(0, 1)
            p.index_copy_(1, slots, t.reshape(p.shape[0], n * self.block_size, *p.shape[2:]).to(self.device))
            off += width
