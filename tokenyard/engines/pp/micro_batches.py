"""The engine's step under pipeline parallelism: up to P micro-batches in flight.

With one batch at a time, each of P stages idles while the others work (a bubble of (P-1)/P).
So each step schedules a new batch from the sequences that are not in flight and submits it to
the pipeline, and collects the oldest batch once P are in flight (or nothing else can be
scheduled): stage 0 on rank 0 works on batch k+1 while stage 1 works on batch k.

Invariants (what keeps scheduling correct with batches in flight):
- each batch takes at most 1/P of the live sequences (running and waiting), so that decoding
  sequences spread over the P batches rather than all riding in one;
- a sequence is in at most one in-flight batch: the scheduler skips busy sequences, and its
  sampled token is appended (and its num_computed_tokens advanced) when its batch is collected,
  before it can be scheduled again;
- a busy sequence is never preempted (its blocks are being written): victims come from the
  rest, and a busy sequence's abort waits until its batch is collected;
- full blocks are registered in the prefix cache at collection only, when every stage has
  written them, so no other sequence can match a block still being computed.
Batches leave the pipeline in the order they entered (every stage handles them in that order).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Protocol

from tokenyard.engines.core.outputs import StepOutput
from tokenyard.engines.core.scheduler import Scheduler, SchedulerOutput
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.pp.pipeline_runner import InFlight, PipelineRunner


class StepHost(Protocol):
    """What the stepper uses of its engine (tokenyard.engines.runtime.engine.Engine, which imports this module)."""

    scheduler: Scheduler
    runner: PipelineRunner

    def _take_aborts(self) -> list[Sequence]: ...
    def _finish(self, seq: Sequence, reason: str, new_tokens: list[int], *args: Any, **kw: Any) -> StepOutput: ...
    def _apply(self, batch: SchedulerOutput, results: list[tuple[list[int], int]], t0: float) -> list[StepOutput]: ...
    def _fail_all(self, exc: Exception) -> list[StepOutput]: ...


class MicroBatcher:
    def __init__(self, engine: StepHost, depth: int) -> None:
        self.engine = engine
        self.depth = depth                     # most batches in flight: the stage count
        self.flights: deque[InFlight] = deque()
        self.busy: set[Sequence] = set()       # sequences in some in-flight batch
        self.deferred_aborts: list[Sequence] = []
        self._last_collect = time.perf_counter()

    @property
    def num_in_flight(self) -> int:
        return len(self.flights)

    def step(self) -> list[StepOutput]:
        eng = self.engine
        outputs: list[StepOutput] = []
        pending, self.deferred_aborts = self.deferred_aborts + eng._take_aborts(), []
        for seq in pending:
            if seq.is_finished:
                continue
            if seq in self.busy:
                self.deferred_aborts.append(seq)
            else:
                outputs.append(eng._finish(seq, "abort", []))
        try:
            if len(self.flights) >= self.depth:
                outputs += self._collect()
            # Each batch takes its share of the live sequences, so that the next one finds some
            # to run: one batch of everything would leave the other stages nothing to overlap.
            sched = eng.scheduler
            share = -(-(len(sched.running) + len(sched.waiting)) // self.depth)
            batch = sched.schedule(busy=self.busy, max_chunks=share)
            if batch.chunks:
                self.flights.append(eng.runner.submit(batch))
                self.busy.update(c.seq for c in batch.chunks)
            elif self.flights:
                outputs += self._collect()
        except Exception as exc:  # noqa: BLE001 - the pipeline's state is unknown: fail everything
            self.flights.clear()
            self.busy.clear()
            self.deferred_aborts.clear()
            return outputs + eng._fail_all(exc)
        return outputs

    def _collect(self) -> list[StepOutput]:
        flight = self.flights.popleft()
        tokens = iter(self.engine.runner.collect(flight))
        results = [([next(tokens)] if c.samples else [], c.num_tokens) for c in flight.batch.chunks]
        for c in flight.batch.chunks:
            self.busy.discard(c.seq)
        # Step time: from when this batch entered or the previous one left, whichever is later,
        # so overlapping batches are not counted twice in the engine's busy seconds.
        t0 = max(flight.submitted, self._last_collect)
        outs = self.engine._apply(flight.batch, results, t0)
        self._last_collect = time.perf_counter()
        return outs
