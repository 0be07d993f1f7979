"""Token sampling: greedy, temperature, top-k, top-p, with per-request reproducible randomness.
Penalties and logit_bias (apply_adjustments) and grammar masks change a row's logits first.

The random draw for a request's i-th output token comes from a generator seeded by
mix(seed, i) alone. Nothing about the batch (its size, order, or what else is in it) and nothing
about preemption (which recomputes KV but not choices) can change a seeded request's output.
Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) picks token t with probability
p_t, and needs one uniform stream per row.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from tokenyard.engines.model.token_masks import for_rows

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): well-spread 63-bit seeds for neighbouring indices."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Return probabilities after temperature, top-k and top-p, row by row. logits: [S, V] fp32."""
    logits = logits / temperature[:, None]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if need_k:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            k = torch.where(top_k > 0, top_k, logits.shape[-1])
            sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        if need_p:
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's first highest logit. fp32 CPU logits go through numpy: over one row of a 49,152-token
    vocabulary torch's argmax took about 80 us on a 2-core VM and numpy's 4 us, where a SmolLM2 batch-1
    decode step takes about 5 ms. Both take the first maximum (and a NaN as the maximum)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, greedy: list[bool], temperature: list[float], top_k: list[int],
           top_p: list[float], seeds: list[int], indices: list[int],
           constraints: Sequence[Any] | None = None,
           adjustments: Sequence[LogitAdjust | None] | None = None) -> list[int]:
    """logits [S, V] fp32 -> one token per row. indices: each row's output position.
    constraints: per row, a grammar constraint or None; only those rows are masked.
    adjustments: per row, penalties and bias (applied before temperature, greedy rows too) or None."""
    if adjustments is not None:
        logits = apply_adjustments(logits, adjustments)
    out = [0] * logits.shape[0]
    done: set[int] = set()   # constrained greedy rows, picked under their masks without a masked copy
    if constraints is not None:
        logits, done = _constrained(logits, constraints, greedy, out)
    greedy_rows = [i for i, g in enumerate(greedy) if g and i not in done]
    if greedy_rows:
        if len(greedy_rows) == len(greedy):
            return greedy_tokens(logits)
        picked = greedy_tokens(logits[greedy_rows])
        for row, tok in zip(greedy_rows, picked):
            out[row] = tok
    rows = [i for i, g in enumerate(greedy) if not g]
    if not rows:
        return out
    dev = logits.device
    probs = filter_logits(
        logits[rows],
        torch.tensor([temperature[i] for i in rows], dtype=torch.float32, device=dev),
        torch.tensor([top_k[i] for i in rows], dtype=torch.long, device=dev),
        torch.tensor([top_p[i] for i in rows], dtype=torch.float32, device=dev),
    )
    gen = torch.Generator(device=dev)
    noise = torch.empty(len(rows), logits.shape[-1], device=dev)
    for j, i in enumerate(rows):
        gen.manual_seed(mix_seed(seeds[i], indices[i]))
        noise[j].exponential_(generator=gen)
    picked = (probs / noise).argmax(dim=-1).tolist()
    for row, tok in zip(rows, picked):
        out[row] = tok
    return out


class LogitAdjust(NamedTuple):
    """One row's penalties and bias; output_ids: the tokens generated so far (the prompt is not counted)."""

    presence_penalty: float
    frequency_penalty: float
    logit_bias: dict[int, float]
    output_ids: Sequence[int]


def apply_adjustments(logits: torch.Tensor, adjustments: Sequence[LogitAdjust | None]) -> torch.Tensor:
    """OpenAI's rule, row by row: logit[t] - frequency * count[t] - presence * (count[t] > 0) + bias[t].
    Rows whose adjustment is None are untouched. Returns a new tensor (logits may be an inference tensor)."""
    rows = [i for i, a in enumerate(adjustments) if a is not None]
    if not rows:
        return logits
    dev = logits.device
    vocab = logits.shape[-1]
    delta = torch.zeros(logits.shape, dtype=logits.dtype, device=dev)
    flat = delta.view(-1)
    # Counts of every (row, token) pair in one scatter: flat index row * vocab + token.
    pen_rows = [i for i in rows if adjustments[i].presence_penalty or adjustments[i].frequency_penalty]  # type: ignore[union-attr]
    if pen_rows:
        idx = [i * vocab + t for i in pen_rows for t in adjustments[i].output_ids]  # type: ignore[union-attr]
        if idx:
            counts = torch.zeros(logits.numel(), dtype=logits.dtype, device=dev)
            counts.index_add_(0, torch.tensor(idx, dtype=torch.long, device=dev),
                              torch.ones(len(idx), dtype=logits.dtype, device=dev))
            counts = counts.view(logits.shape)
            freq = torch.zeros(logits.shape[0], dtype=logits.dtype, device=dev)
            pres = torch.zeros(logits.shape[0], dtype=logits.dtype, device=dev)
            sel = torch.tensor(pen_rows, dtype=torch.long, device=dev)
            freq[sel] = torch.tensor([adjustments[i].frequency_penalty for i in pen_rows],  # type: ignore[union-attr]
                                     dtype=logits.dtype, device=dev)
            pres[sel] = torch.tensor([adjustments[i].presence_penalty for i in pen_rows],  # type: ignore[union-attr]
                                     dtype=logits.dtype, device=dev)
            delta -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(logits.dtype)
    bias_idx = [i * vocab + t for i in rows for t in adjustments[i].logit_bias]  # type: ignore[union-attr]
    if bias_idx:
        values = [float(b) for i in rows for b in adjustments[i].logit_bias.values()]  # type: ignore[union-attr]
        flat.index_add_(0, torch.tensor(bias_idx, dtype=torch.long, device=dev),
                        torch.tensor(values, dtype=logits.dtype, device=dev))
    return logits + delta


def _constrained(logits: torch.Tensor, constraints: Sequence[Any], greedy: list[bool],
                 out: list[int]) -> tuple[torch.Tensor, set[int]]:
    """The grammar masks: a greedy row's token is picked under its mask now (into out; TokenMasks.greedy
    reads the bitmask, no masked copy), the other constrained rows' logits are masked for the draw.
    Returns (the logits to draw from, the rows already picked)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits, set()
    masks = for_rows([constraints[i] for i in rows], logits.shape[-1], logits.device)
    picked = [j for j, i in enumerate(rows) if greedy[i]]
    if picked:
        for j, tok in zip(picked, masks.select(picked).greedy(logits, [rows[j] for j in picked])):
            out[rows[j]] = tok
    drawn = [j for j, i in enumerate(rows) if not greedy[i]]
    if drawn:
        logits = masks.select(drawn).apply(logits, [rows[j] for j in drawn])
    return logits, {rows[j] for j in picked}


def apply_token_masks(logits: torch.Tensor, constraints: Sequence[Any]) -> torch.Tensor:
    """Set to -inf the logits each row's grammar forbids; rows whose constraint is None are untouched.
    A constraint has fill_bitmask(bitmask, row): int32 words, bit t % 32 of word t // 32 allows token t
    (tokenyard.engines.core.structured_output.Constraint). logits: [S, V] fp32; returns a masked copy.
    The masks may have been filled while the forward ran (tokenyard/engines/model/token_masks.py)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    masks = for_rows([constraints[i] for i in rows], logits.shape[-1], logits.device)
    return masks.apply(logits, rows)
