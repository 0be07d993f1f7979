"""Decode steps replayed from captured CUDA graphs, one graph per batch size of a ladder.

A decode step of a small batch is a few hundred tiny kernels; on a GPU their launch overhead
alone can exceed the time the step spends reading weights. Capturing the whole forward once per
batch size and replaying it turns those launches into one. Prefill (and any mixed or verify
batch) stays eager: its shapes vary every step and its kernels are big enough to hide launches.

A captured graph reads and writes fixed addresses, so every input lives in a static buffer
sized for the largest batch of the ladder. A batch of n sequences runs the smallest captured
size B >= n; rows n..B-1 are padding: slot -1 (the Triton write_kv kernel skips it), context
length 1 over block 0 (a harmless read) and their logits ignored. The Triton attention picks
its split count from shapes alone (the block-table width is fixed here), so nothing in the
forward syncs with the host and the capture is valid for every replay.

`capture=False` runs the same static-buffer, padded path eagerly. It is what the CPU tests use
(under TRITON_INTERPRET=1) to check the padding and bucketing against the ordinary path, since
graphs themselves need a GPU.
"""
from __future__ import annotations

import torch

from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.model import CausalLM


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (vLLM-like: dense where batches are common)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class CudaGraphDecoder:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks_per_seq: int, max_batch: int, device: torch.device, capture: bool = True) -> None:
        if capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use capture=False to run the padded path eagerly")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.ladder = batch_size_ladder(max_batch)
        self.max_batch = self.ladder[-1]
        self.width = max_blocks_per_seq
        b = self.max_batch
        self.ids = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.full((b,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(b, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def bucket(self, n: int) -> int | None:
        for size in self.ladder:
            if size >= n:
                return size
        return None

    def can_run(self, n: int, max_blocks: int) -> bool:
        return 0 < n <= self.max_batch and max_blocks <= self.width

    def _meta(self, size: int) -> AttentionMetadata:
        # Views into the static buffers: the captured kernels read these exact addresses.
        return AttentionMetadata(
            slot_mapping=self.slots[:size], query_lens=[1] * size, seq_lens=[], block_tables=[],
            block_size=self.block_size, backend="triton", sliding_window=self.model.cfg.sliding_window,
            query_start_loc_t=self.query_start_loc[:size + 1], seq_lens_t=self.seq_lens[:size],
            block_tables_t=self.block_tables[:size])

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.ids[:size], self.positions[:size], self._meta(size), self.kv_caches,
                          self.rows[:size])

    def _capture_all(self) -> None:
        pool = None
        # Largest first so the smaller graphs reuse the biggest one's memory pool.
        for size in reversed(self.ladder):
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile Triton kernels and settle allocator state outside capture
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(size)
            pool = graph.pool()
            self._graphs[size] = graph
            self._outputs[size] = out
        torch.cuda.synchronize(self.device)

    def run(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One decode token per sequence; returns fp32 logits [n, vocab]."""
        n = len(ids)
        size = self.bucket(n)
        assert size is not None and n > 0
        dev = self.device
        # Host -> static buffers. Padding rows are reset so a stale slot is never written.
        self.ids[:n].copy_(torch.tensor(ids, dtype=torch.long), non_blocking=True)
        self.positions[:n].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slots[:n].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.slots[n:size].fill_(-1)
        self.seq_lens[:n].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        self.seq_lens[n:size].fill_(1)
        table = torch.zeros(n, self.width, dtype=torch.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.block_tables[:n].copy_(table.to(dev, non_blocking=True))
        self.block_tables[n:size].zero_()
        if self.capture:
            self._graphs[size].replay()
            return self._outputs[size][:n]
        return self._forward(size)[:n]
