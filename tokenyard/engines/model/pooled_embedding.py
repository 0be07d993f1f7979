"""Sentence embeddings from the decoder: mean-pooled final hidden states, L2-normalised.

    vectors = embed_prompts(model, [[1, 2, 3], [4, 5]], max_batch_tokens=512)   # [2, hidden] float32

A prefill-only forward of the model's own layers (DecoderLayer.qkv / finish, as the paged path and
the compiled decode step use them) with causal attention computed here by
`scaled_dot_product_attention` over each prompt alone: no KV cache is read or written, no block is
allocated and nothing is sampled, so a request that is generating at the same time is untouched.
The pooled state is the one the LM head reads (after the final RMSNorm), averaged over every token
of the prompt in float32 and divided by its L2 norm.

Prompts are packed into flat batches of at most `max_batch_tokens` tokens (a longer prompt runs
alone), the same shape a prefill step has; the caller decides where each batch runs (the engine's
step thread: Engine.embed, AsyncEngine.embed).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.prompt_packing import pack
from tokenyard.engines.model.model import CausalLM


def check_prompts(prompts: Any, vocab_size: int, max_len: int) -> list[list[int]]:
    """A non-empty list of non-empty token-id lists, each id in the vocabulary and each prompt at most
    max_len tokens (no room for an output token is needed); RequestError naming the first bad one."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise RequestError("embeddings need a non-empty list of prompts (lists of token ids)")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, (list, tuple)) or not p:
            raise RequestError(f"prompt {i} must be a non-empty list of token ids")
        if len(p) > max_len:
            raise RequestError(f"prompt {i} has {len(p)} tokens; this engine embeds at most {max_len}")
        for t in p:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise RequestError(f"prompt {i}: token {t!r} is not an integer id in [0, {vocab_size})")
        out.append(list(p))
    return out


@torch.inference_mode()
def embed_batch(model: CausalLM, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), hidden] float32 unit vectors, one forward over the prompts' tokens."""
    device = model.embed_tokens.weight.device
    lens = [len(p) for p in prompts]
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    window = model.cfg.sliding_window
    masks = {n: _window_mask(n, window, device) for n in set(lens) if window is not None and n > window}
    h = model.embed_tokens(ids)
    for layer in model.layers:
        q, k, v = layer.qkv(h, positions, model.rotary)
        outs = []
        for qs, ks, vs in zip(q.split(lens), k.split(lens), v.split(lens)):
            mask = masks.get(qs.shape[0])
            # [heads, T, D]; the kv heads are shared by groups of query heads (enable_gqa).
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                               enable_gqa=True)
            outs.append(o.transpose(0, 1))
        h = layer.finish(h, torch.cat(outs))
    h = model.norm(h).float()
    pooled = torch.stack([s.mean(0) for s in h.split(lens)])
    return F.normalize(pooled, p=2.0, dim=-1)


def embed_prompts(model: CausalLM, prompts: list[list[int]], max_batch_tokens: int) -> torch.Tensor:
    """Every prompt's vector, in order, batch by batch (see pack)."""
    parts = [embed_batch(model, [prompts[i] for i in idx]) for idx in pack(prompts, max_batch_tokens)]
    return torch.cat(parts) if parts else torch.empty(0, model.cfg.hidden_size)


def _window_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    """Causal and within the sliding window, as the paged path masks (key > query - window)."""
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
