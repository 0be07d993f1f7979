"""Megatron-style tensor parallelism for the Llama-family model, applied to a loaded model in place.

Each of N ranks keeps 1/N of every layer:
- attention: q, k and v heads split by rank (column-parallel qkv_proj), o_proj split along its
  input (row-parallel), so each rank's partial output is summed by one all-reduce;
- MLP: gate and up rows split (column-parallel), down_proj split along its input (row-parallel),
  one all-reduce;
- embedding and LM head split by vocabulary: each rank looks up only its rows (others give 0)
  and an all-reduce assembles the embedding; the LM head's partial logits are all-gathered.
Row-parallel biases live on rank 0 only, so the all-reduce adds them exactly once.

The split is taken from the full, loaded weights, so the checkpoint loader stays unaware of it
and every rank computes exactly the fp32 math of the unsplit model up to summation order.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.tp.fp32_partials import wrap_row_parallel_


def check_divisible(cfg: ModelConfig, world: int) -> None:
    for name, value in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise CheckpointError(f"tensor_parallel_size {world} does not divide {name} ({value})")


def local_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The per-rank shapes: what one rank's layers and KV cache hold."""
    check_divisible(cfg, world)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // world, num_kv_heads=cfg.num_kv_heads // world,
                               intermediate_size=cfg.intermediate_size // world)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        vocab = full.shape[0]
        per = -(-vocab // world)
        self.start = rank * per
        self.stop = min(vocab, self.start + per)
        self.weight = nn.Parameter(full[self.start:self.stop].clone(), requires_grad=False)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary slice, gathered so every rank returns [rows, vocab]."""

    def __init__(self, weight: nn.Parameter, vocab: int, per: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.weight = weight  # may be the embedding's shard (tied embeddings)
        self.vocab = vocab
        self.per = per
        self.world = world
        self.group = group

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(h, self.weight)
        if local.shape[1] < self.per:  # the last shard may be short; pad so all_gather sizes match
            local = nn.functional.pad(local, (0, self.per - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab]


def _rows(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return t[start:start + size]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


@torch.no_grad()
def shard_model_(model: CausalLM, rank: int, world: int, group: dist.ProcessGroup | None = None) -> CausalLM:
    """Keep this rank's slice of every weight and insert the collectives. Returns the model."""
    cfg = model.cfg
    loc = local_config(cfg, world)
    q, kv, lq, lkv, f, lf = cfg.q_size, cfg.kv_size, loc.q_size, loc.kv_size, cfg.intermediate_size, loc.intermediate_size
    for layer in model.layers:
        qkv = layer.qkv_proj
        pieces = [_rows(qkv.weight, rank * lq, lq), _rows(qkv.weight, q + rank * lkv, lkv),
                  _rows(qkv.weight, q + kv + rank * lkv, lkv)]
        qkv.weight = _param(torch.cat(pieces))
        if qkv.bias is not None:
            b = qkv.bias
            qkv.bias = _param(torch.cat([_rows(b, rank * lq, lq), _rows(b, q + rank * lkv, lkv),
                                         _rows(b, q + kv + rank * lkv, lkv)]))
        layer.o_proj.weight = _param(layer.o_proj.weight[:, rank * lq:(rank + 1) * lq])
        gu = layer.gate_up_proj
        gu.weight = _param(torch.cat([_rows(gu.weight, rank * lf, lf), _rows(gu.weight, f + rank * lf, lf)]))
        if gu.bias is not None:
            gu.bias = _param(torch.cat([_rows(gu.bias, rank * lf, lf), _rows(gu.bias, f + rank * lf, lf)]))
        layer.down_proj.weight = _param(layer.down_proj.weight[:, rank * lf:(rank + 1) * lf])
        for row_parallel in (layer.o_proj, layer.down_proj):
            if row_parallel.bias is not None and rank != 0:
                row_parallel.bias = None
        wrap_row_parallel_(layer)   # bf16 partials summed in fp32 (fp32_partials.py says why)
        layer.cfg = loc
        layer.tp_group = group
        layer.tp_enabled = True
    vocab = cfg.vocab_size
    per = -(-vocab // world)
    full_head = model.lm_head.weight
    embed = VocabParallelEmbedding(model.embed_tokens.weight, rank, world, group)
    head_weight = embed.weight if cfg.tie_word_embeddings else _param(full_head[embed.start:embed.stop])
    model.embed_tokens = embed
    model.lm_head = ParallelLMHead(head_weight, vocab, per, world, group)
    model.local_cfg = loc
    return model
