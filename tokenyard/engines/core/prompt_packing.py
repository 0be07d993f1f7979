"""Prompts grouped into flat batches of at most N tokens, the shape a prefill step has.

Pure Python on purpose: the embeddings path calls it in processes that never import torch (a
replica's parent, whose engine steps in a core process of its own).
"""
from __future__ import annotations


def pack(prompts: list[list[int]], max_batch_tokens: int) -> list[list[int]]:
    """Indices of prompts grouped into batches of at most max_batch_tokens tokens, in order (a longer
    prompt runs alone)."""
    batches: list[list[int]] = []
    used = 0
    for i, p in enumerate(prompts):
        if not batches or used + len(p) > max_batch_tokens:
            batches.append([])
            used = 0
        batches[-1].append(i)
        used += len(p)
    return batches
