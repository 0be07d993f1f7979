"""Load the weights of a GGUF checkpoint into `CausalLM`, dequantised to the engine's dtype (kept
quantised instead: tokenyard/engines/quant/gguf_quantized.py).

Every tensor is mapped to its Hugging Face name (`gguf_reader.hf_name`) and from there to the
engine's parameter (fused q/k/v and gate/up rows) by the same table the safetensors loader uses,
so the two loaders agree on which tensors a model needs: a missing, unexpected or mis-shaped
tensor is an error naming it and the file.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.formats import gguf_reader as gr
from tokenyard.engines.model.model import CausalLM, empty_model
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.weights.weight_names import PROGRESS_MIN_BYTES, parameter_targets

log = logging.getLogger(__name__)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def plan(path: str | Path, cfg: ModelConfig) -> list[tuple[object, str, tuple[str, slice | None, tuple[int, ...]]]]:
    """(gguf tensor, HF name, (our parameter, rows, shape)) for every weight tensor, checked:
    names known, shapes as the metadata implies, nothing missing; rope_freqs is left out."""
    reader = gr.open_gguf(path)
    targets = parameter_targets(cfg)
    out, unexpected, seen = [], [], set()
    for t in reader.tensors:
        if t.name == gr.ROPE_FREQS:
            continue
        hf = gr.hf_name(t.name)
        if hf is None or hf not in targets:
            unexpected.append(t.name)
            continue
        ours, rows, shape = targets[hf]
        if gr.logical_shape(t) != shape:
            raise CheckpointError(f"{path}: tensor {t.name} has shape {gr.logical_shape(t)}, the metadata implies {shape}")
        out.append((t, hf, targets[hf]))
        seen.add(hf)
    if unexpected:
        raise CheckpointError(f"{path}: {len(unexpected)} unexpected tensor(s) for {cfg.architecture}: {_shown(unexpected)}")
    missing = [n for n in targets if n not in seen]
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) missing (as HF names): {_shown(missing)}")
    return out


def float_weight(path: str | Path, cfg: ModelConfig, t: object, hf: str) -> torch.Tensor:
    """One tensor as float32, in Hugging Face row order (q/k unpermuted for llama files)."""
    w = gr.dequantize(t)
    heads = gr.qk_heads(gr.architecture(gr.open_gguf(path), path), cfg, hf)
    return gr.unpermute_rows(w, heads) if heads else w


def load_gguf_model(path: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                    progress: bool = True, cfg: ModelConfig | None = None) -> tuple[CausalLM, ModelConfig]:
    """The GGUF counterpart of `checkpoint.load_model`: every weight dequantised to `dtype`."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_dir(path)
    reader = gr.open_gguf(path)
    gr.check_types(reader, path)
    jobs = plan(path, cfg)
    model = empty_model(cfg, dtype, device, max_positions)
    params = dict(model.named_parameters())
    total = sum(int(t.n_bytes) for t, _, _ in jobs)
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {path.name}",
                               disable=not progress or total < PROGRESS_MIN_BYTES) as bar:
        for t, hf, (ours, rows, _shape) in jobs:
            dest = params[ours] if rows is None else params[ours][rows]
            dest.copy_(float_weight(path, cfg, t, hf).to(dtype))
            bar.update(int(t.n_bytes))
    factors = gr.rope_factors(path, cfg)
    if factors is not None:
        gr.apply_rope_factors(model, cfg, factors)
    model.eval()
    return model, cfg
