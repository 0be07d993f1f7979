"""What the engine calls to load its model: plain, quantised at load, a pre-quantised checkpoint as
stored, or a GGUF file with its quantised blocks kept where the layouts agree.

One dispatcher above the loaders, so that none of them needs to know the others.
"""
from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenyard.engines.formats.gguf_reader import is_gguf
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.quant import prepared_model
from tokenyard.engines.quant.gguf_quantized import load_gguf_quantized
from tokenyard.engines.quant.quantization import check_mode, checkpoint_quantization, load_quantized_model, quantize_model
from tokenyard.engines.weights.checkpoint import load_model

if TYPE_CHECKING:
    from tokenyard.engines.core.startup_phases import StartupPhases


def resolve_quantization(model_dir: str | Path, quantization: str, group_size: int) -> tuple[str, int]:
    """`quantization: auto` as (mode, group size): a GGUF file as its layers are stored (4-bit blocks
    or fewer: int4 in groups of 32, the blocks' own size, so Q4_0/Q4_1 are kept as stored; 5- to
    8-bit: int8; floats: none), a checkpoint from `tokenyard quantize` as written, anything else
    none. An explicit mode is kept as given."""
    if quantization != "auto":
        return quantization, group_size
    if is_gguf(model_dir):
        from tokenyard.engines.formats.gguf_reader import stored_precision
        mode = stored_precision(model_dir)
        return mode, 32 if mode == "int4" else group_size
    qc = checkpoint_quantization(model_dir)
    if qc is not None:
        return qc["mode"], int(qc.get("group_size") or group_size)
    return "none", group_size


def load_engine_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
                      progress: bool, cfg: ModelConfig, quantization: str = "none",
                      group_size: int = 128, phases: StartupPhases | None = None) -> tuple[CausalLM, ModelConfig]:
    """The engine's loader: plain, quantised at load, or a pre-quantised checkpoint as stored.
    phases: where quantising after the read is timed ("quantise_pack"); a GGUF's blocks are
    repacked as they are read, so that time stays in the caller's weights_read.
    GGUF files and quantise-at-load results come from the prepared-weights cache when it holds
    them, and are stored there after a load (prepared_model.py)."""
    key = prepared_model.model_key(model_dir, dtype, device, max_positions, quantization, group_size)
    if key is not None:
        model = prepared_model.restore(key, cfg, dtype, device, max_positions)
        if model is not None:
            return model, cfg
    model, cfg = _load(model_dir, dtype, device, max_positions, progress, cfg, quantization, group_size, phases)
    if key is not None:
        prepared_model.save(key, model, model_dir)
    return model, cfg


def _load(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
          progress: bool, cfg: ModelConfig, quantization: str, group_size: int,
          phases: StartupPhases | None) -> tuple[CausalLM, ModelConfig]:
    qc = checkpoint_quantization(model_dir)
    if qc is not None:
        if quantization not in ("none", qc["mode"]) or (quantization == "int4" and group_size != qc["group_size"]):
            raise ValueError(f"{model_dir} is quantised to {qc['mode']}"
                             + (f" with group size {qc['group_size']}" if qc["mode"] == "int4" else "")
                             + f"; the engine asks for quantization={quantization} (group size {group_size}): "
                               f"use the checkpoint's settings, or none")
        return load_quantized_model(model_dir, dtype, device, max_positions, progress, cfg)
    if quantization == "none":
        return load_model(model_dir, dtype, device, max_positions, progress, cfg)
    check_mode(quantization, group_size)
    if is_gguf(model_dir):
        # GGUF blocks that match a layout are taken as stored, the rest requantised (gguf_loader).
        model, cfg, _report = load_gguf_quantized(model_dir, dtype, device, max_positions, quantization,
                                                  group_size, progress=progress, cfg=cfg)
        return model, cfg
    # Quantise from float32 weights (as save_quantized does), then bring the rest to dtype.
    model, cfg = load_model(model_dir, torch.float32, device, max_positions, progress, cfg)
    with phases.phase("quantise_pack") if phases is not None else nullcontext():
        quantize_model(model, quantization, group_size)
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.to(dtype)
            for m in model.modules():
                if isinstance(m, QuantLinear) and m.bias is not None:
                    m.bias = m.bias.to(dtype)
    return model, cfg
