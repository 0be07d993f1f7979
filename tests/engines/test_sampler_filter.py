"""The sampler's top-p and top-k filter, exactly: which tokens stay and their renormalised mass
(issue 45.12: a top_p that dropped the token crossing the threshold passed every sampling test)."""
from __future__ import annotations

import pytest
import torch

from tokenyard.engines.model.sampler import filter_logits

PROBS = [0.15, 0.5, 0.05, 0.3]          # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 0), 0.05 (id 2)


def _filter(top_p: float, top_k: int = 0) -> list[float]:
    logits = torch.tensor([PROBS]).log()
    return filter_logits(logits, torch.tensor([1.0]), torch.tensor([top_k]), torch.tensor([top_p]))[0].tolist()


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [1]),              # the first token alone already reaches 0.3
    (0.6, [1, 3]),           # 0.5 < 0.6: the token that crosses it (0.3, to 0.8) is kept
    (0.8001, [1, 3, 0]),     # 0.8 < 0.8001: the crossing token is 0.15 (id 0)
    (0.96, [1, 3, 0, 2]),
    (1.0, [1, 3, 0, 2]),
])
def test_top_p_keeps_the_smallest_prefix_reaching_p_including_the_crossing_token(top_p, kept):
    got = _filter(top_p)
    mass = sum(PROBS[i] for i in kept)
    want = [PROBS[i] / mass if i in kept else 0.0 for i in range(4)]
    assert got == pytest.approx(want, abs=1e-6)


def test_top_k_then_top_p():
    # top_k 2 leaves 0.5 and 0.3 (renormalised 0.625, 0.375); top_p 0.7 then needs both.
    assert _filter(0.7, top_k=2) == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)
    assert _filter(0.6, top_k=2) == pytest.approx([0.0, 1.0, 0.0, 0.0], abs=1e-6)
