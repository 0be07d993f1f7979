"""Turns a scheduled batch into flat model inputs, runs one forward, and samples."""
from __future__ import annotations

import torch

from .attention import AttentionMetadata
from .model import CausalLM
from .sampler import sample
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 device: torch.device, attention_backend: str = "torch") -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attention_backend = attention_backend
        self.sliding_window = model.cfg.sliding_window

    def execute(self, batch: SchedulerOutput) -> list[int]:
        """Run the batch; return one sampled token per chunk that reaches its sequence's end."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        sampled = []
        for chunk in batch.chunks:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            table = seq.block_table
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(chunk.num_tokens)
            seq_lens.append(end)
            tables.append(table)
            if chunk.samples:
                logits_rows.append(len(ids) - 1)
                sampled.append(seq)
        dev = self.device
        meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables, bs, self.sliding_window, dev,
                                       self.attention_backend)
        logits = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), meta, self.kv_caches,
                            torch.tensor(logits_rows, dtype=torch.long, device=dev))
        if not sampled:
            return []
        return sample(
            logits,
            greedy=[s.params.temperature == 0.0 for s in sampled],
            temperature=[s.params.temperature for s in sampled],
            top_k=[s.params.top_k for s in sampled],
            top_p=[s.params.top_p for s in sampled],
            seeds=[s.seed for s in sampled],
            indices=[s.num_output_tokens for s in sampled],
        )
