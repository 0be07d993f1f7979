"""A small draft model that proposes k tokens per sequence, with its own paged KV cache.

The draft shares the target's tokenizer (same vocabulary; checked at start). For each sequence
it keeps a block table and how many of the sequence's tokens it has K/V for. A proposal first
catches up on the tokens it has not seen (the prompt on first use, then the target's accepted
tokens) in one flat forward with every other sequence, then runs k - 1 single-token steps; each
round samples from the draft's own filtered distribution q (argmax for greedy requests) and
keeps q for the acceptance test.

Rollback: after verification only the K/V of accepted tokens stays valid, so `rollback` lowers
the computed count and truncates the table; a target preemption (which keeps the tokens) needs
nothing, since the draft's K/V still matches the same token prefix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenyard.engines.core.block_manager import BlockManager
from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model.kv_cache import allocate_kv_cache
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.model_runner import ModelRunner, StepInputs
from tokenyard.engines.model.runner_config import RunnerConfig
from tokenyard.engines.model.sampler import filter_logits, mix_seed
from tokenyard.engines.weights.checkpoint import load_model

# Separates the draft's sampling stream from the target's for the same (seed, index).
DRAFT_SALT = 0xD4AF_7000


@dataclass(slots=True)
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [len(tokens), V] draft distributions; None for greedy


class DraftProposer:
    name = "draft"

    def __init__(self, model_dir: str | Path, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, num_blocks: int, block_size: int, attention_backend: str,
                 kv_cache_dtype: str = "auto") -> None:
        cfg = ModelConfig.from_dir(model_dir)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise CheckpointError(f"draft model {model_dir} has vocab_size {cfg.vocab_size}, the target has "
                                  f"{target_cfg.vocab_size}: a draft must share the target's tokenizer")
        self.model, self.cfg = load_model(model_dir, dtype, device, max_model_len, False, cfg)
        # The draft stores K/V like the target (kv_cache_dtype); its rolled-back slots are simply
        # written again, codes and scales together.
        kv = allocate_kv_cache(cfg, num_blocks, block_size, dtype, device, kv_cache_dtype)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, kv, device, RunnerConfig(block_size, attention_backend))
        self.block_size = block_size
        self._states: dict[str, _DraftState] = {}

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] tokens for seqs[i]; fewer (or none) when the draft's KV blocks run out."""
        out = [Proposal([], None) for _ in seqs]
        live: list[int] = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self._states.setdefault(seq.request_id, _DraftState())
            # The last token always goes in (its logits give d1), even if its K/V exists.
            st.num_computed = min(st.num_computed, seq.num_tokens - 1)
            need = seq.num_tokens + k - 1  # K/V slots written by k rounds
            if k > 0 and self.blocks.can_grow(st.block_table, need):
                self.blocks.grow(st.block_table, need)
                live.append(i)
        if not live:
            return out
        # Round 1: catch up on unseen tokens, sample d1 from the last row.
        feeds = [seqs[i].token_ids[self._states[seqs[i].request_id].num_computed:] for i in live]
        for r in range(max(ks[i] for i in live)):
            active = [j for j, i in enumerate(live) if len(out[i].tokens) < ks[i]]
            if not active:
                break
            logits = self._forward([seqs[live[j]] for j in active], [feeds[j] for j in active])
            for row, j in enumerate(active):
                i = live[j]
                tok, probs = self._sample(seqs[i], logits[row], len(out[i].tokens))
                out[i].tokens.append(tok)
                if probs is not None:
                    out[i].probs = probs[None] if out[i].probs is None else torch.cat([out[i].probs, probs[None]])
                feeds[j] = [tok]
        return out

    def _forward(self, seqs: list[Sequence], feeds: list[list[int]]) -> torch.Tensor:
        bs = self.block_size
        inputs = StepInputs([], [], [], [], [], [], [])
        for seq, feed in zip(seqs, feeds):
            st = self._states[seq.request_id]
            start = st.num_computed
            end = start + len(feed)
            table = st.block_table
            inputs.ids.extend(feed)
            inputs.positions.extend(range(start, end))
            inputs.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            inputs.query_lens.append(len(feed))
            inputs.seq_lens.append(end)
            inputs.tables.append(table)
            inputs.logits_rows.append(len(inputs.ids) - 1)
            st.num_computed = end
        return self.runner.forward(inputs)

    @staticmethod
    def _sample(seq: Sequence, logits: torch.Tensor, round_index: int) -> tuple[int, torch.Tensor | None]:
        p = seq.params
        if p.temperature == 0.0:
            return int(logits.argmax()), None
        probs = filter_logits(logits[None], torch.tensor([p.temperature]), torch.tensor([p.top_k]),
                              torch.tensor([p.top_p]))[0]
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(mix_seed(seq.seed ^ DRAFT_SALT, seq.num_output_tokens + round_index))
        return int(torch.multinomial(probs, 1, generator=gen)), probs

    def rollback(self, seq: Sequence, num_valid: int) -> None:
        """Keep K/V only for the first num_valid tokens of seq (its accepted prefix)."""
        st = self._states.get(seq.request_id)
        if st is None:
            return
        st.num_computed = min(st.num_computed, num_valid)
        keep = self.blocks.blocks_needed(st.num_computed)
        if keep < len(st.block_table):
            dropped = st.block_table[keep:]
            del st.block_table[keep:]
            self.blocks.pool.release(dropped[::-1])

    def release(self, request_id: str) -> None:
        st = self._states.pop(request_id, None)
        if st is not None and st.block_table:
            self.blocks.pool.release(st.block_table[::-1])
            st.block_table.clear()

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks
