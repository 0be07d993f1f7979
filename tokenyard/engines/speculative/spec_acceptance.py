"""The acceptance rule of speculative sampling, which keeps the target model's distribution exactly.

Given k proposed tokens d_1..d_k drawn from the proposer's distributions q_i, and the target's
distributions p_1..p_{k+1} at the same positions (from one verify forward):
- accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), in order, stopping at the first reject;
- at a reject, emit one token from the residual max(0, p_i - q_i), normalised;
- when all k are accepted, emit a bonus token from p_{k+1}.
Every emitted token is then distributed as the target would have sampled it (Leviathan et al.
2023; Chen et al. 2023). Prompt lookup proposes deterministically: q_i is one-hot on d_i, so the
test is "accept with probability p_i(d_i)" and the residual is p_i without d_i.
Greedy requests are the limit: accept while d_i equals the target's argmax, then emit the argmax.
That argmax is taken over the same fp32 logits the ordinary sampler uses, so greedy output is
identical with and without speculation.

The draws come from one generator seeded by (request seed, output index of the first new token),
so a seeded request is reproducible; its tokens differ from a non-speculative run with the same
seed (different draws are consumed) while following the same distribution.
"""
from __future__ import annotations

import torch

from tokenyard.engines.model.sampler import mix_seed

# Keeps the speculative draw streams apart from the ordinary sampler's for the same (seed, index).
SPEC_SALT = 0x5BEC_D1CE


def accept_greedy(target_logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """target_logits [k+1, V]: the tokens to emit (accepted drafts, then the target's own)."""
    best = target_logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        if d != best[i]:
            break
        out.append(d)
    out.append(best[len(out)])
    return out


def accept_sampled(target_probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   seed: int, index: int) -> list[int]:
    """target_probs [k+1, V] (temperature/top-k/top-p applied); draft_probs [k, V] or None when
    the proposals are deterministic (one-hot q). index: output index of the first new token."""
    gen = torch.Generator(device=target_probs.device)
    gen.manual_seed(mix_seed(seed ^ SPEC_SALT, index))
    k = len(drafts)
    uniforms = torch.rand(max(k, 1), generator=gen, device=target_probs.device).tolist()
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = target_probs[i]
        p_d = float(p[d])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if q_d > 0 and uniforms[i] * q_d < p_d:  # u < p/q without dividing
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q exactly: nothing left to correct
            residual = p
        out.append(int(torch.multinomial(residual, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=gen)))
    return out
