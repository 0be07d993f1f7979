"""Continuous batching: which tokens of which sequences run in the next forward pass.

There are no separate prefill and decode phases. Each step spends a token budget
(max_num_batched_tokens): first one token for every running sequence that is decoding, then the
rest of any running sequence's unfinished prefill, then new sequences from the waiting queue,
whose prompts are split over steps when the budget runs out (chunked prefill). A sequence
"catches up" when num_computed_tokens reaches its token count, and is then sampled.

When prefill_burst_tokens is set (off by default), the budget grows to it while BURST_MIN_PROMPTS
or more prompts wait for their prefill (a burst of arrivals, a queue): their waiting is shortened
only by prefill throughput, and a step's decode rows cost the same beside a 2,048-token chunk as
beside a 512-token one. With fewer prompts pending the short budget holds, so an arrival stalls the
running streams for one short step (bench/RESULTS.md, served W2: ITL p99 at 32 clients against
96-at-once throughput).

A seeded request's prompt prefill stops at the last full block before its final token (where a
prefix-cache hit would start) and computes the rest as a chunk of its own, so its output is the same
whether or not its prompt was cached (issue 45.4).

Blocks are allocated just ahead of use. When a running sequence needs a block and none is free,
the least urgent running sequence (highest priority value, then latest arrival) is preempted by
recompute: its blocks are freed and it waits again with its generated tokens kept.
"""
from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field

from tokenyard.engines.core.block_manager import BlockManager
from tokenyard.engines.core.sequence import Sequence, SequenceStatus

# Prompts pending (waiting, or admitted with prefill left) from which a step takes the burst budget.
# At 32 streaming clients a new prompt arrives every step or two and is done in one or two steps, so
# fewer than four pending is the steady state there; a burst of arrivals or a queue is more.
BURST_MIN_PROMPTS = 4


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0   # 0: a single request's chunk is capped only by the budget
    watermark_blocks: int = 0               # free blocks kept back when admitting new sequences
    prefill_burst_tokens: int = 0           # the budget while BURST_MIN_PROMPTS prompts are pending (0: off)
    max_adapters: int = 0                   # most distinct LoRA adapters in one step (the pool's slots; 0: no cap)


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int           # tokens to compute this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager) -> None:
        self.cfg = cfg
        self.blocks = blocks
        self.waiting: list[Sequence] = []     # kept sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self, busy: Collection[Sequence] = (), max_chunks: int = 0) -> SchedulerOutput:
        """busy: running sequences in a batch still being computed (pipeline micro-batches,
        tokenyard/engines/pp/micro_batches.py): they are neither scheduled nor preempted this step.
        max_chunks > 0: at most that many sequences in this batch (so micro-batches share them)."""
        out = SchedulerOutput()
        budget = self._budget()
        scheduled: dict[int, ScheduledChunk] = {}
        adapters: set[int] = set()   # LoRA adapters in this batch: at most max_adapters (the pool's slots)
        # Decoding sequences first so a long prefill never stalls anyone's stream, then
        # unfinished prefills; within each, most urgent first.
        order = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.sort_key()))
        for seq in order:
            if budget <= 0 or 0 < max_chunks <= len(scheduled):
                break
            if seq.status is not SequenceStatus.RUNNING or seq in busy:
                continue  # preempted earlier in this loop, or in flight
            if not self._adapter_fits(seq, adapters):
                continue  # its adapter would need one pool slot more than there are: a later step
            n = self._chunk_len(seq, budget)
            while not self.blocks.can_grow(seq.block_table, seq.num_computed_tokens + n):
                # seq itself is always a candidate, so there is one.
                victim = max((s for s in self.running if s not in busy), key=Sequence.sort_key)
                dropped = scheduled.pop(id(victim), None)
                if dropped is not None:
                    budget += dropped.num_tokens
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            scheduled[id(seq)] = ScheduledChunk(seq, n)
            adapters.add(seq.lora_id)
            budget -= n
        # Admit waiting sequences while the budget, max_num_seqs and free blocks allow.
        held: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs \
                and not 0 < max_chunks <= len(scheduled):
            seq = self.waiting[0]
            if seq in out.preempted:
                break  # do not re-admit in the same step what was just pushed out
            if self._prefix_in_flight(seq) or not self._adapter_fits(seq, adapters):
                held.append(self.waiting.pop(0))   # behind a prefill of its prefix, or no slot for its adapter
                continue
            # Admit only when the whole uncached prompt fits with the watermark to spare, so an
            # admitted prefill is not preempted half-way by the next arrival.
            hit = self.blocks.match_prefix(seq)
            reserve = self.cfg.watermark_blocks if self.running else 0
            if not self.blocks.can_admit(seq, hit, reserve):
                break
            self.waiting.pop(0)
            self.blocks.adopt(seq, hit)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = self._chunk_len(seq, budget)
            self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
            scheduled[id(seq)] = ScheduledChunk(seq, n)
            adapters.add(seq.lora_id)
            budget -= n
        for seq in held:
            bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        out.chunks = list(scheduled.values())
        return out

    def _adapter_fits(self, seq: Sequence, adapters: set[int]) -> bool:
        """True when seq's LoRA adapter (if any) can join this batch's: already in it, or a slot is left."""
        cap = self.cfg.max_adapters
        if not cap or not seq.lora_id or seq.lora_id in adapters:
            return True
        return len(adapters - {0}) < cap

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """True when a running sequence (same cache salt) is still prefilling this very prompt (the n
        choices of one request, or a duplicate): this one waits until that prompt's first token is
        out, then finds the prompt's full blocks in the prefix cache instead of computing them a
        second time. Waiting that long, not just until the shared blocks are done, makes the steps it
        joins the same whether the prefix was cached or not, and the same however the arrivals fell:
        the n choices of one seeded request repeat exactly (issue 45.4). Only the whole prompt
        counts: prompts that merely share a first block (a system prompt, a chat preamble: nearly all
        chat traffic) are never held, or a burst of them would be admitted one per prefill."""
        if not self.blocks.enable_prefix_caching or seq.num_output_tokens:
            return False
        bs = self.blocks.block_size
        if seq.num_tokens <= bs:
            return False
        return any(r.num_output_tokens == 0 and r.num_tokens == seq.num_tokens and r.cache_salt == seq.cache_salt
                   and r.lora_id == seq.lora_id and r.token_ids == seq.token_ids for r in self.running)

    def _budget(self) -> int:
        budget = self.cfg.max_num_batched_tokens
        if self.cfg.prefill_burst_tokens > budget:
            pending = len(self.waiting)
            if pending < BURST_MIN_PROMPTS:
                pending += sum(1 for s in self.running if s.num_tokens - s.num_computed_tokens > 1)
            if pending >= BURST_MIN_PROMPTS:
                return self.cfg.prefill_burst_tokens
        return budget

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        cap = self.cfg.long_prefill_token_threshold
        if cap > 0:
            n = min(n, cap)
        if seq.params.seed is not None and seq.num_output_tokens == 0 and self.blocks.enable_prefix_caching:
            # A seeded prompt's prefill stops where a prefix-cache hit would start (match_prefix), and
            # computes its tail in a chunk of its own: cold or warm, the tail's KV and the first token's
            # logits then come from the same computation. One chunk of the whole prompt rounds them
            # differently from a tail over cached blocks (another batch shape), which changed a seeded
            # request's sampled output between its first run and the next (issue 45.4).
            cacheable = (seq.num_tokens - 1) // self.blocks.block_size * self.blocks.block_size
            if seq.num_computed_tokens < cacheable:
                n = min(n, cacheable - seq.num_computed_tokens)
        return n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
