"""The grammar masks of a step, filled on a thread of their own while the step's forward runs.

    prefetch = MaskPrefetch(device)                  # the engine's; close() ends its thread
    pending = prefetch.start(constraints, vocab)     # as soon as the step's batch is known
    ... the forward ...                              # the sampler takes the masks (token_masks.for_rows)
    pending.wait()                                   # before any constraint accepts a token

Why: at batch 32 the masks (xgrammar's fill, the closing rule, the bits unpacked) cost a few ms a
step on the host, between the forward and the sample, on the step's critical path. Filling only reads a
matcher's state, and the forward never touches one, so both can run at once: xgrammar's fill releases
the GIL, and the C decode step and torch's kernels run without it. On a GPU the host is otherwise idle
during the forward; on a CPU the fill takes a core the forward may be using (the engine option
grammar_mask_overlap turns this off; bench/RESULTS.md has both measured).

Rules:
- One worker thread, one fill at a time: a step waits for its own fill (the sampler joins it) and
  the engine waits for it before its constraints accept the sampled tokens, so a matcher is never
  filled and advanced at once.
- The masks are the same as filled inline (the same function, token_masks.TokenMasks.fill); a fill
  that raises raises in the sampler, as an inline one would, failing the step.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from tokenyard.engines.model.token_masks import PendingMasks, TokenMasks


class MaskPrefetch:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: ThreadPoolExecutor | None = None   # made on the first constrained step

    def start(self, constraints: Sequence[Any], vocab: int) -> PendingMasks:
        """Begin filling the masks of `constraints` (row j: constraints[j]); each carries the result
        as `prefetched` until it accepts a token."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenyard-grammar-mask")
        cons = list(constraints)
        pending = PendingMasks(self._pool.submit(TokenMasks.fill, cons, vocab, self.device), cons, vocab)
        for c in cons:
            c.prefetched = pending
        return pending

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
