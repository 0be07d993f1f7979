"""Test-only helpers that reach into engine internals (the engine never needs these)."""
from __future__ import annotations

import torch

from tokenyard.engines import Engine
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model.attention import AttentionMetadata


def prompt_logits(engine: Engine, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits at every position of `token_ids`, computed through the paged cache in chunks."""
    seq = Sequence("logits-probe", list(token_ids), SamplingParams(), 0, 0, 0, frozenset())
    blocks = engine.blocks
    chunk = chunk or len(token_ids)
    rows = []
    try:
        while seq.num_computed_tokens < len(token_ids):
            n = min(chunk, len(token_ids) - seq.num_computed_tokens)
            blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            bs = blocks.block_size
            slots = [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            meta = AttentionMetadata.build(slots, [n], [end], [seq.block_table], bs,
                                           engine.model_config.sliding_window, engine.device)
            out = engine.model(torch.tensor(token_ids[start:end]), torch.arange(start, end), meta,
                               engine.runner.kv_caches, torch.arange(n))
            rows.append(out)
            seq.num_computed_tokens = end
    finally:
        blocks.free(seq)
    return torch.cat(rows)


def run_to_completion(engine: Engine, max_steps: int = 100_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]
