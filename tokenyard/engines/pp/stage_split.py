"""Which layers a pipeline stage holds, cutting a loaded model down to them, and its forward.

Stage s of P holds a contiguous run of decoder layers (sizes differ by at most one, the earlier
stages taking the extra ones); the first stage also holds the embedding, the last the final norm
and the LM head. A stage's forward is CausalLM.forward cut at the stage's edges, so the stages
chained together compute exactly the single-process math.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The layer indices of every stage, in order."""
    if num_stages > num_layers:
        raise CheckpointError(f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} decoder "
                              f"layers: every stage needs at least one")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class StagePart:
    """What one stage holds: its index, the stage count and its layer range."""

    stage: int
    num_stages: int
    layers: range

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def kv_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config a KV cache for this stage's layers is allocated from (pass the per-rank
        config under tensor parallelism)."""
        return dataclasses.replace(cfg, num_layers=len(self.layers))


def trim_to_stage_(model: CausalLM, part: StagePart) -> CausalLM:
    """Drop every layer (and the embedding / head) that another stage holds. In place."""
    model.layers = nn.ModuleList(model.layers[i] for i in part.layers)
    if not part.first:
        model.embed_tokens = None
    if not part.last:
        model.norm = None
        model.lm_head = None
    return model


@torch.inference_mode()
def stage_forward(model: CausalLM, part: StagePart, x: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata, kv_caches: list, logits_rows: torch.Tensor) -> torch.Tensor:
    """x: token ids [T] on the first stage, else the previous stage's hidden states [T, hidden].
    Returns hidden states [T, hidden], or on the last stage fp32 logits for logits_rows."""
    h = model.embed_tokens(x) if part.first else x
    for layer, kv in zip(model.layers, kv_caches):
        h = layer(h, positions, model.rotary, kv, meta)
    if not part.last:
        return h
    return model.lm_head(model.norm(h.index_select(0, logits_rows))).float()
