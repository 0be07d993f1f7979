"""A PEFT LoRA adapter's adapter_config.json, read and checked against what the engine serves.

What is served: plain LoRA (peft_type LORA) on the decoder's q/k/v/o and gate/up/down projections,
rank 1..max_lora_rank, one rank and alpha for every module, scaling alpha / r (or alpha / sqrt(r)
when use_rslora is true). Everything else PEFT can write changes the math in ways the batched
products do not do, so it is refused by name rather than served wrongly: DoRA, LoRA biases,
fan_in_fan_out (GPT-2's Conv1D), per-module rank/alpha patterns, modules_to_save (full copies of
other layers), and targets other than the seven projections.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokenyard.engines.core.errors import CheckpointError

# PEFT's module names of the projections the engine adds adapters to.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(CheckpointError):
    """An adapter that cannot be served on this base: the message names the file, key or tensor."""


@dataclass(slots=True, frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]   # the subset of TARGET_MODULES the config names (all when a regex)
    base_model: str | None            # base_model_name_or_path, informative only

    @property
    def scale(self) -> float:
        """What the product B(Ax) is multiplied by."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def read_adapter_config(adapter_dir: str | Path, max_rank: int = 64) -> AdapterConfig:
    path = Path(adapter_dir) / CONFIG_FILE
    if not path.is_file():
        raise AdapterError(f"{adapter_dir}: no {CONFIG_FILE} (a PEFT LoRA adapter folder has {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise AdapterError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: expected a JSON object")

    def bad(key: str, why: str) -> AdapterError:
        return AdapterError(f"{path}: {key} {why}")

    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise bad("peft_type", f"is {peft_type!r}; only LORA adapters are served")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise bad("r", f"must be an integer rank in 1..{max_rank} (max_lora_rank), got {rank!r}")
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise bad("use_rslora", f"must be true or false, got {use_rslora!r}")
    if raw.get("use_dora"):
        raise bad("use_dora", "is true: DoRA adapters are not served (only plain LoRA)")
    if raw.get("bias", "none") not in ("none", None):
        raise bad("bias", f"is {raw.get('bias')!r}: adapters with bias terms are not served (need \"none\")")
    if raw.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "is true: that layout is for GPT-2's Conv1D layers, not this engine's models")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise bad(key, "is set: per-module ranks or alphas are not served (one r and lora_alpha for all)")
    if raw.get("modules_to_save"):
        raise bad("modules_to_save", f"is {raw['modules_to_save']!r}: adapters carrying full copies of other "
                                     f"layers are not served")
    targets = raw.get("target_modules")
    if isinstance(targets, str) or targets is None:
        # A regex (or PEFT's default for the architecture): the tensors themselves say which.
        names = TARGET_MODULES
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise bad("target_modules", f"names {', '.join(unknown)}: adapters are served on "
                                        f"{', '.join(TARGET_MODULES)} only")
        names = tuple(t for t in TARGET_MODULES if t in targets)
    else:
        raise bad("target_modules", f"must be a list of module names or a regex, got {targets!r}")
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(rank, float(alpha), use_rslora, names, base if isinstance(base, str) else None)
