"""Read a PEFT LoRA adapter folder into per-(layer, module) A and B matrices, checked against the base.

PEFT saves each adapted projection as two tensors,
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]
(some versions keep the adapter's name before ".weight"). Every tensor must be one of these, for a
layer the base has, with the base's input and output sizes and the config's rank, or loading stops
with an AdapterError naming the tensor: an adapter trained for another base (another hidden size,
layer count or head layout) is caught here, not served as noise.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenyard.engines.lora.adapter_config import (
    TARGET_MODULES,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    read_adapter_config,
)
from tokenyard.engines.model.model_config import ModelConfig

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection PEFT can adapt, on this base."""
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


# The decoder's fused projections (tokenyard/engines/model/model.py), by the group name the model passes
# to LayerLora.apply, and the PEFT modules whose outputs they concatenate, in order.
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def group_layout(cfg: ModelConfig) -> dict[str, tuple[int, int, list[tuple[str, int, int]]]]:
    """group -> (in_features, fused out_features, [(module, column offset, width), ...])."""
    shapes = module_shapes(cfg)
    out = {}
    for group, modules in GROUPS.items():
        cuts, off = [], 0
        for m in modules:
            cuts.append((m, off, shapes[m][1]))
            off += shapes[m][1]
        out[group] = (shapes[modules[0]][0], off, cuts)
    return out


@dataclass(slots=True)
class Adapter:
    """One adapter's weights: (layer, module) -> (A [r, in], B [out, r]), in the engine's dtype."""

    name: str
    path: Path
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def load_adapter(name: str, adapter_dir: str | Path, base: ModelConfig, dtype: torch.dtype,
                 max_rank: int = 64) -> Adapter:
    """The adapter at adapter_dir (adapter_config.json + adapter_model.safetensors), checked against base."""
    from safetensors import safe_open

    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir, max_rank)
    path = adapter_dir / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {WEIGHTS_FILE} (only the safetensors format is read)")
    shapes = module_shapes(base)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(f"{path}: tensor {key} is not a LoRA A/B weight of a decoder projection "
                                       f"({', '.join(TARGET_MODULES)})")
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in shapes:
                    raise AdapterError(f"{path}: tensor {key} targets {module}; adapters are served on "
                                       f"{', '.join(TARGET_MODULES)} only")
                if module not in cfg.target_modules:
                    raise AdapterError(f"{path}: tensor {key} targets {module}, which target_modules does not name")
                if layer >= base.num_layers:
                    raise AdapterError(f"{path}: tensor {key} is for layer {layer}, but the base has "
                                       f"{base.num_layers} layers (an adapter for another base?)")
                t = f.get_tensor(key)
                n_in, n_out = shapes[module]
                want = (cfg.rank, n_in) if half == "A" else (n_out, cfg.rank)
                if tuple(t.shape) != want:
                    raise AdapterError(f"{path}: tensor {key} has shape {list(t.shape)}, expected {list(want)} "
                                       f"(r={cfg.rank}; the base's {module} is {n_in} -> {n_out})")
                halves.setdefault((layer, module), {})[half] = t
    except AdapterError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise AdapterError(f"{path}: not a readable safetensors file ({e})") from e
    adapter = Adapter(name, adapter_dir, cfg)
    for (layer, module), pair in sorted(halves.items()):
        missing = {"A", "B"} - set(pair)
        if missing:
            raise AdapterError(f"{path}: layers.{layer}.{module} has lora_{missing.pop()} missing "
                               f"(each adapted projection needs lora_A and lora_B)")
        adapter.weights[(layer, module)] = (pair["A"].to(dtype).contiguous(), pair["B"].to(dtype).contiguous())
    if not adapter.weights:
        raise AdapterError(f"{path}: no LoRA tensors")
    return adapter
