"""Speculative decoding inside continuous batching.

Each step the scheduler plans as usual (decode tokens first, then prefill chunks). Then, for
each decoding sequence, a proposer (prompt lookup or a draft model) offers up to k tokens; they
are appended to the sequence for this one forward, so its chunk becomes [last token, d_1..d_k]
and the target scores all k+1 positions in the same flat batch as everyone else's prefill and
decode rows (the attention interface handles a verify chunk like a short prefill chunk). The
acceptance rule (spec_acceptance) picks the tokens to emit; the drafts are taken off again and
the caller appends what was emitted.

Rollback is exact: a sequence's computed count advances only over its last token and the
accepted drafts, the blocks grown for rejected positions are truncated, and prefix-cache
hashes are only ever taken over full blocks of computed, accepted tokens. Stale K/V written for
rejected positions sits in slots past the computed count and is overwritten before it is read.

Speculation pays while the step is bound by reading weights, i.e. at small batches; past
`spec_max_batch` decoding sequences the step runs without it (measured in bench/RESULTS.md).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tokenyard.engines.core.block_manager import BlockManager
from tokenyard.engines.core.scheduler import SchedulerOutput
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model.model_runner import ModelRunner, sample_sequences
from tokenyard.engines.model.sampler import filter_logits
from tokenyard.engines.speculative import spec_acceptance
from tokenyard.engines.speculative.draft_proposer import DraftProposer
from tokenyard.engines.speculative.ngram_proposer import NgramProposer


@dataclass(slots=True)
class SpecStats:
    proposer: str
    num_verifications: int = 0     # sequence-steps that verified at least one draft
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0           # accepted + the one corrected/bonus token per verification
    num_skipped_steps: int = 0     # steps run without speculation (batch past spec_max_batch)
    num_spec_steps: int = 0        # steps that verified drafts
    propose_seconds: float = 0.0   # time spent proposing (draft forwards, n-gram search)
    verify_seconds: float = 0.0    # time of the verify steps' target forward + acceptance

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (1 means no draft survived; k+1 means all did)."""
        return self.num_emitted / self.num_verifications if self.num_verifications else 0.0


@dataclass(slots=True)
class StepResult:
    new_tokens: list[int]   # emitted tokens (empty for a prefill chunk that does not sample)
    num_computed: int       # tokens of the sequence whose K/V this step made valid


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, proposer: NgramProposer | DraftProposer,
                 num_speculative_tokens: int, max_batch: int, max_model_len: int) -> None:
        self.runner = runner
        self.blocks = blocks
        self.proposer = proposer
        self.k = num_speculative_tokens
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.stats = SpecStats(proposer.name)

    def _budget(self, seq: Sequence) -> int:
        # Drafts past max_tokens would be thrown away (the emitted token after them counts too),
        # and positions must stay inside max_model_len.
        # A grammar-constrained sequence is not speculated: drafts would need the mask of every
        # verify position (a state per draft prefix); it decodes one masked token per step.
        if seq.constraint is not None:
            return 0
        # Penalties count the output so far, which differs at every verify position, and logprobs
        # are taken where the token is sampled: neither is speculated.
        if seq.params.adjusts_logits or seq.params.logprobs is not None:
            return 0
        left = seq.params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(self.k, left, self.max_model_len - seq.num_tokens))

    def execute(self, batch: SchedulerOutput) -> list[StepResult]:
        chunks = batch.chunks
        samples = [c.samples for c in chunks]
        decoding = [i for i, c in enumerate(chunks) if samples[i] and c.num_tokens == 1]
        if not decoding or len(decoding) > self.max_batch:
            if decoding:
                self.stats.num_skipped_steps += 1
            return self._plain(batch, samples)
        seqs = [chunks[i].seq for i in decoding]
        ks = [self._budget(s) for s in seqs]
        t0 = time.perf_counter()
        if isinstance(self.proposer, NgramProposer):
            proposals = [self.proposer.propose_one(s.token_ids, k) if k else [] for s, k in zip(seqs, ks)]
            draft_probs = [None] * len(seqs)
        else:
            props = self.proposer.propose(seqs, ks)
            proposals = [p.tokens for p in props]
            draft_probs = [p.probs for p in props]
        drafts: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        for i, seq, toks, q in zip(decoding, seqs, proposals, draft_probs):
            if toks and self.blocks.can_grow(seq.block_table, seq.num_tokens + len(toks)):
                self.blocks.grow(seq.block_table, seq.num_tokens + len(toks))
                seq.token_ids.extend(toks)       # only for this forward; taken off below
                chunks[i].num_tokens += len(toks)
                drafts[i] = (toks, q)
            elif toks and isinstance(self.proposer, DraftProposer):
                self.proposer.rollback(seq, seq.num_tokens)  # drafted but not verified: drop its K/V
        t1 = time.perf_counter()
        self.stats.propose_seconds += t1 - t0
        if not drafts:
            return self._plain(batch, samples)
        try:
            logits, rows = self._forward(batch, samples, set(drafts))
        finally:
            for i, (toks, _) in drafts.items():
                seq = chunks[i].seq
                del seq.token_ids[-len(toks):]
                chunks[i].num_tokens = 1
        results = [StepResult([], c.num_tokens) for c in chunks]
        plain = [i for i in range(len(chunks)) if samples[i] and i not in drafts]
        if plain:
            picked = self._sample_rows(logits, [rows[i][-1] for i in plain], [chunks[i].seq for i in plain])
            for i, tok in zip(plain, picked):
                results[i].new_tokens = [tok]
        spec_rows = {i: rows[i] for i in drafts}
        self._verify(logits, spec_rows, drafts, chunks, results)
        self.stats.verify_seconds += time.perf_counter() - t1
        self.stats.num_spec_steps += 1
        return results

    def _verify(self, logits: torch.Tensor, spec_rows: dict[int, list[int]], drafts: dict, chunks, results) -> None:
        sampled = [i for i in drafts if chunks[i].seq.params.temperature > 0.0]
        probs: dict[int, torch.Tensor] = {}
        if sampled:
            flat = [r for i in sampled for r in spec_rows[i]]
            seqs = [chunks[i].seq for i in sampled for _ in spec_rows[i]]
            p_all = filter_logits(logits[flat], torch.tensor([s.params.temperature for s in seqs]),
                                  torch.tensor([s.params.top_k for s in seqs]),
                                  torch.tensor([s.params.top_p for s in seqs]))
            start = 0
            for i in sampled:
                n = len(spec_rows[i])
                probs[i] = p_all[start:start + n]
                start += n
        for i, (toks, q) in drafts.items():
            seq = chunks[i].seq
            if i in probs:
                emitted = spec_acceptance.accept_sampled(probs[i], toks, q, seq.seed, seq.num_output_tokens)
            else:
                emitted = spec_acceptance.accept_greedy(logits[spec_rows[i]], toks)
            accepted = len(emitted) - 1
            results[i] = StepResult(emitted, 1 + accepted)
            # Blocks were grown for every draft; keep those the emitted tokens need.
            self.blocks.truncate(seq, seq.num_tokens + len(emitted))
            if isinstance(self.proposer, DraftProposer):
                self.proposer.rollback(seq, seq.num_tokens + accepted)
            st = self.stats
            st.num_verifications += 1
            st.num_proposed += len(toks)
            st.num_accepted += accepted
            st.num_emitted += len(emitted)

    def _forward(self, batch: SchedulerOutput, samples: list[bool],
                 verify: set[int]) -> tuple[torch.Tensor, list[list[int]]]:
        """One target forward; logits for every row of a verify chunk and the last row of the
        other sampling chunks. rows[i]: chunk i's rows in the returned logits."""
        inputs, _ = self.runner.prepare(batch)
        inputs.logits_rows = []
        rows: list[list[int]] = []
        offset = 0
        for i, (c, s) in enumerate(zip(batch.chunks, samples)):
            offset += c.num_tokens
            mine: list[int] = []
            if s:
                first = offset - c.num_tokens if i in verify else offset - 1
                for r in range(first, offset):
                    mine.append(len(inputs.logits_rows))
                    inputs.logits_rows.append(r)
            rows.append(mine)
        return self.runner.forward(inputs), rows

    def _plain(self, batch: SchedulerOutput, samples: list[bool]) -> list[StepResult]:
        tokens = iter(self.runner.execute(batch))
        return [StepResult([next(tokens)] if s else [], c.num_tokens) for c, s in zip(batch.chunks, samples)]

    @staticmethod
    def _sample_rows(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[int]:
        return sample_sequences(logits[rows], seqs)

    def release(self, seq: Sequence) -> None:
        if isinstance(self.proposer, DraftProposer):
            self.proposer.release(seq.request_id)
