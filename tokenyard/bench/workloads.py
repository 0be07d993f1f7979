"""Benchmark workloads, seeded so every run and every server sees the same requests."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


def w2(num_requests: int = 96, vocab_size: int = 8192, input_range: tuple[int, int] = (32, 512),
       output_range: tuple[int, int] = (16, 256), seed: int = 0) -> list[Request]:
    """W2: random token prompts, input and output lengths uniform over the ranges (inclusive)."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_range[0], input_range[1] + 1, num_requests)
    outs = rng.integers(output_range[0], output_range[1] + 1, num_requests)
    return [Request(rng.integers(3, vocab_size, int(n)).tolist(), int(m)) for n, m in zip(ins, outs)]


# W2's model: a random ~30M-parameter Llama (d=512, 8 layers, 8 heads, 2 KV heads, FFN 1408).
W2_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
