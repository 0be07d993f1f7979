"""Load a Hugging Face checkpoint folder (config.json + safetensors) into `CausalLM`.

Every tensor the model needs must be present with the right shape, and every tensor in the
files must be used: a missing, unexpected or mis-shaped tensor is an error naming it, never a
silently random weight.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.model.model import CausalLM, empty_model
from tokenyard.engines.model.model_config import ModelConfig
from tokenyard.engines.weights.gguf_loader import load_gguf_model
from tokenyard.engines.weights.weight_names import PROGRESS_MIN_BYTES, parameter_targets

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise CheckpointError(f"{model_dir}: shard(s) named in {index.name} are missing: {', '.join(missing)}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(model_dir.glob("*.bin")):
        raise CheckpointError(f"{model_dir}: only PyTorch .bin weights found; convert to safetensors "
                              "(pickle files are not loaded)")
    raise CheckpointError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_weights(model: CausalLM, model_dir: str | Path, dtype: torch.dtype, progress: bool = True) -> None:
    model_dir = Path(model_dir)
    files = safetensors_files(model_dir)
    targets = parameter_targets(model.cfg)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    unexpected: list[str] = []
    total = sum(p.stat().st_size for p in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {model_dir.name}",
               disable=not progress or total < PROGRESS_MIN_BYTES)
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt") as fh:
                for name in fh.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                        continue  # some tied checkpoints still store a copy of the embedding
                    if name not in targets:
                        unexpected.append(name)
                        continue
                    tensor = fh.get_tensor(name)
                    ours, rows, shape = targets[name]
                    if tuple(tensor.shape) != shape:
                        raise CheckpointError(
                            f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {shape}")
                    dest = params[ours] if rows is None else params[ours][rows]
                    dest.copy_(tensor.to(dtype))
                    seen.add(name)
                    bar.update(tensor.numel() * tensor.element_size())
    bar.close()
    if unexpected:
        shown = ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else "")
        raise CheckpointError(f"{model_dir}: {len(unexpected)} unexpected tensor(s) for {model.cfg.architecture}: {shown}")
    missing = [n for n in targets if n not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CheckpointError(f"{model_dir}: {len(missing)} tensor(s) missing: {shown}")


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               progress: bool = True, cfg: ModelConfig | None = None) -> tuple[CausalLM, ModelConfig]:
    if Path(model_dir).suffix.lower() == ".gguf" and not Path(model_dir).is_dir():
        return load_gguf_model(model_dir, dtype, device, max_positions, progress, cfg)
    cfg = cfg or ModelConfig.from_dir(model_dir)
    model = empty_model(cfg, dtype, device, max_positions)
    load_weights(model, model_dir, dtype, progress)
    model.eval()
    return model, cfg
