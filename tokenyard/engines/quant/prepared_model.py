"""A loaded engine model kept in, and restored from, the prepared-weights cache (formats/prepared_cache.py).

What is cached: loads whose result costs far more than reading it back, on a CPU device: a GGUF
file (its blocks repacked for torch's int4 op, its int8 head requantised) and any checkpoint
quantised at load (`quantization: int8 | int4` on float weights). Plain float checkpoints are
read as they are and are not cached.

The entry holds every parameter and buffer of the finished model by name (QuantLinear's packed
forms included) and, per QuantLinear, what rebuilds it without repacking
(`QuantLinear.prepared_state`). Restoring builds the skeleton as the loaders do, puts each layer
back and points every parameter at the mapped entry: no copy, no repacking. An entry whose names,
shapes or dtypes do not match the skeleton is treated as corrupt (removed, rebuilt).

The key: the checkpoint's content identity, the mode, group size, dtype, device type, rotary
positions, the quantised-matmul backend override and the format version (plus torch's version and
the CPU, prepared_cache.make_key). The model carries it as `weights_cache_key`, so the C decode
step can cache its own forms of the same weights (tokenyard/engines/model/native_step_cache.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenyard import knobs
from tokenyard.engines.formats import prepared_cache
from tokenyard.engines.formats.gguf_reader import is_gguf
from tokenyard.engines.model.model import CausalLM
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.model.quantized_linear import QuantLinear
from tokenyard.engines.quant.quantization import _empty_model, _parent

log = logging.getLogger(__name__)

KIND = "model"
FORMAT = 1       # of this module's meta; bump when what is stored changes


def model_key(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
              quantization: str, group_size: int) -> str | None:
    """The cache key of this load, or None when it is not cached (cache off, a GPU, a plain float load)."""
    if prepared_cache.cache_dir() is None or device.type != "cpu":
        return None
    if not is_gguf(model_dir) and quantization == "none":
        return None
    return prepared_cache.make_key(KIND, {
        "source": prepared_cache.source_identity(model_dir), "format": FORMAT, "quantization": quantization,
        "group_size": group_size if quantization == "int4" else None, "dtype": str(dtype), "device": device.type,
        "max_positions": max_positions, "quant_backend": knobs.quant_backend()})


def _state(model: CausalLM) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers())
    return {n: t.detach() for n, t in out.items()}


def save(key: str, model: CausalLM, source: str | Path) -> None:
    quant = {name: m.prepared_state() for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    path = prepared_cache.store(KIND, key, _state(model), {"format": FORMAT, "quant": quant,
                                                           "source": Path(source).name})
    if path is not None:
        model.weights_cache_key = key
        log.info("%s: prepared weights cached in %s", Path(source).name, path)


def restore(key: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
            max_positions: int) -> CausalLM | None:
    """The cached model for `key`, or None (no entry, or a bad one: removed, and the caller loads)."""
    entry = prepared_cache.load(KIND, key)
    if entry is None:
        return None
    try:
        model = _build(entry, cfg, dtype, device, max_positions)
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        log.warning("prepared-weights cache: %s does not fit the model (%s); rebuilding it", entry.path, exc)
        entry.path.unlink(missing_ok=True)
        return None
    model.weights_cache_key = key
    return model


def _build(entry: prepared_cache.Entry, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
           max_positions: int) -> CausalLM:
    meta, tensors = entry.meta, entry.tensors
    if meta.get("format") != FORMAT:
        raise ValueError(f"meta format {meta.get('format')}, expected {FORMAT}")
    quant: dict[str, dict] = meta["quant"]
    model = _empty_model(cfg, dtype, device, max_positions, list(quant))
    for name, state in quant.items():
        bufs = {b: tensors[f"{name}.{b}"] for b in state["buffers"] if f"{name}.{b}" in tensors}
        parent, attr = _parent(model, name)
        setattr(parent, attr, QuantLinear.from_prepared(state, bufs))
    expected = _state(model)
    # QuantLinear buffers are in place already; None buffers (no bias) are neither listed nor stored
    if expected.keys() != tensors.keys():
        missing, extra = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
        raise ValueError(f"tensor names differ (missing {missing[:3]}, unexpected {extra[:3]})")
    with torch.no_grad():
        for n, p in model.named_parameters():       # a tied head shares its Parameter: set once
            _check(n, p, tensors[n])
            p.data = tensors[n]
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            for n, b in module._buffers.items():
                if b is not None and prefix + n in tensors:
                    _check(prefix + n, b, tensors[prefix + n])
                    module._buffers[n] = tensors[prefix + n]
    model.eval()
    return model


def _check(name: str, have: torch.Tensor, got: torch.Tensor) -> None:
    if have.shape != got.shape or have.dtype != got.dtype:
        raise ValueError(f"{name}: cached {tuple(got.shape)} {got.dtype}, the model has {tuple(have.shape)} {have.dtype}")
