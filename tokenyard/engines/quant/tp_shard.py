"""Weight-only quantisation under tensor parallelism: each rank keeps its slice of the quantised
weights, with the scales (and int4 zero points) that belong to that slice.

The whole weight is quantised first, exactly as the single-process engine does, and the
device-neutral layout (tokenyard.kernels.quant_layout) is then split, so every rank's codes and scales are
the single-process ones:
- column-parallel projections (qkv_proj, gate_up_proj) and the vocabulary-split LM head keep
  whole output rows: codes and per-row scales (int8) or per-row-and-group scales and zeros (int4)
  are cut by rows;
- row-parallel projections (o_proj, down_proj) keep a run of input columns: int8 keeps every
  row's scale (one scale per whole row: the rank's partial dot products use the same scale, so
  their sum is the single-process product); int4 cuts the packed codes at a byte and the groups
  at a group boundary, so each rank's input slice must be a multiple of the group size.
The split layout is then repacked for the rank's backend (QuantLinear), as at any load.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.quant.quantization import checkpoint_quantization, load_quantized_model, quantize_model
from tokenyard.engines.tp.fp32_partials import wrap_row_parallel_
from tokenyard.engines.tp.tensor_parallel import ParallelLMHead, VocabParallelEmbedding, local_config, shard_model_
from tokenyard.engines.weights.checkpoint import load_model
from tokenyard.kernels.quant_layout import Int4Weight, Int8Weight


def load_sharded_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                       progress: bool, cfg: ModelConfig, quantization: str, group_size: int, rank: int, world: int,
                       group: dist.ProcessGroup | None) -> tuple[CausalLM, ModelConfig]:
    """One tensor-parallel rank's model: float, quantised at load, or a quantised checkpoint."""
    stored = checkpoint_quantization(model_dir)
    if quantization == "none" and stored is None:
        model, cfg = load_model(model_dir, dtype, device, max_positions, progress, cfg)
        return shard_model_(model, rank, world, group), cfg
    if stored is not None:
        if quantization not in ("none", stored["mode"]):
            raise ValueError(f"{model_dir} is quantised to {stored['mode']}; the engine asks for quantization="
                             f"{quantization}: use the checkpoint's mode, or none")
        # The "torch" backend keeps the device-neutral layout, which is what gets split.
        model, cfg = load_quantized_model(model_dir, dtype, device, max_positions, progress, cfg, backend="torch")
    else:
        model, cfg = load_model(model_dir, torch.float32, device, max_positions, progress, cfg)
        quantize_model(model, quantization, group_size, backend="torch")
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
    return shard_quantized_model_(model, rank, world, group), cfg


def _layout(lin: QuantLinear) -> Int8Weight | Int4Weight:
    if lin.int4:
        return Int4Weight(lin.packed, lin.scales, lin.zeros, lin.group_size, lin.mins)
    return Int8Weight(lin.w_q, lin.scales)


def _opt_rows(t: torch.Tensor | None, ranges: list[tuple[int, int]]) -> torch.Tensor | None:
    return None if t is None else torch.cat([t[a:a + n] for a, n in ranges]).contiguous()


def take_rows(lin: nn.Module, ranges: list[tuple[int, int]]) -> nn.Module:
    """The output rows [a, a + n) of each (a, n) in ranges, concatenated (column parallelism)."""
    if isinstance(lin, nn.Linear):
        out = nn.Linear(lin.in_features, sum(n for _, n in ranges), bias=lin.bias is not None,
                        device=lin.weight.device, dtype=lin.weight.dtype)
        out.weight = nn.Parameter(_opt_rows(lin.weight, ranges), requires_grad=False)
        if lin.bias is not None:
            out.bias = nn.Parameter(_opt_rows(lin.bias, ranges), requires_grad=False)
        return out
    w = _layout(lin)
    if isinstance(w, Int8Weight):
        part = Int8Weight(_opt_rows(w.w_q, ranges), _opt_rows(w.scales, ranges))
    else:
        part = Int4Weight(_opt_rows(w.packed, ranges), _opt_rows(w.scales, ranges), _opt_rows(w.zeros, ranges),
                          w.group_size, _opt_rows(w.mins, ranges))
    return QuantLinear(part, _opt_rows(lin.bias, ranges))


def take_cols(lin: nn.Module, start: int, size: int, keep_bias: bool) -> nn.Module:
    """Input columns [start, start + size) (row parallelism); the bias only where keep_bias."""
    bias = lin.bias if keep_bias else None
    if isinstance(lin, nn.Linear):
        out = nn.Linear(size, lin.out_features, bias=bias is not None, device=lin.weight.device,
                        dtype=lin.weight.dtype)
        out.weight = nn.Parameter(lin.weight[:, start:start + size].contiguous(), requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return out
    w = _layout(lin)
    if isinstance(w, Int8Weight):
        return QuantLinear(Int8Weight(w.w_q[:, start:start + size].contiguous(), w.scales), bias)
    g = w.group_size
    if start % g or size % g:
        raise ValueError(f"int4 with group size {g} under tensor parallelism needs each rank's slice of a "
                         f"row-parallel layer's input to be a multiple of it: {lin.in_features} split into "
                         f"{size}-wide slices; choose a group size that divides {size}")
    groups = slice(start // g, (start + size) // g)
    part = Int4Weight(w.packed[:, start // 2:(start + size) // 2].contiguous(), w.scales[:, groups].contiguous(),
                      None if w.zeros is None else w.zeros[:, groups].contiguous(), g,
                      None if w.mins is None else w.mins[:, groups].contiguous())
    return QuantLinear(part, bias)


class ShardedLMHead(ParallelLMHead):
    """ParallelLMHead over a vocabulary slice held as a module (quantised or float)."""

    def __init__(self, proj: nn.Module, vocab: int, per: int, world: int, group: dist.ProcessGroup | None) -> None:
        super().__init__(None, vocab, per, world, group)
        self.proj = proj

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self.proj(h)
        if local.shape[1] < self.per:
            local = nn.functional.pad(local, (0, self.per - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, :self.vocab]


@torch.no_grad()
def shard_quantized_model_(model: CausalLM, rank: int, world: int, group: dist.ProcessGroup | None) -> CausalLM:
    """shard_model_ for a model whose linears are QuantLinear (on the "torch" backend, which keeps
    the neutral layout) or nn.Linear: the same split, taken from the quantised layout."""
    cfg = model.cfg
    loc = local_config(cfg, world)
    q, kv, lq, lkv = cfg.q_size, cfg.kv_size, loc.q_size, loc.kv_size
    f, lf = cfg.intermediate_size, loc.intermediate_size
    for layer in model.layers:
        layer.qkv_proj = take_rows(layer.qkv_proj, [(rank * lq, lq), (q + rank * lkv, lkv), (q + kv + rank * lkv, lkv)])
        layer.o_proj = take_cols(layer.o_proj, rank * lq, lq, keep_bias=rank == 0)
        layer.gate_up_proj = take_rows(layer.gate_up_proj, [(rank * lf, lf), (f + rank * lf, lf)])
        layer.down_proj = take_cols(layer.down_proj, rank * lf, lf, keep_bias=rank == 0)
        wrap_row_parallel_(layer)   # packed CPU ops' partials summed in fp32 (tp/fp32_partials.py says why)
        layer.cfg = loc
        layer.tp_group = group
        layer.tp_enabled = True
    vocab = cfg.vocab_size
    per = -(-vocab // world)
    embed = VocabParallelEmbedding(model.embed_tokens.weight, rank, world, group)
    head = model.lm_head
    if cfg.tie_word_embeddings and not isinstance(head, QuantLinear):
        head = nn.Linear(cfg.hidden_size, vocab, bias=False, device=embed.weight.device, dtype=embed.weight.dtype)
        head.weight = model.embed_tokens.weight
    model.embed_tokens = embed
    model.lm_head = ShardedLMHead(take_rows(head, [(embed.start, embed.stop - embed.start)]), vocab, per, world, group)
    model.local_cfg = loc
    return model
