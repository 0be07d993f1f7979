"""Every TOKENYARD_* environment variable the engines, kernels and router runtime read, in one place.

Each knob is a function that reads its variable when called, never at import: tests set them with
monkeypatch, and a process may change them between engine starts. The standard library alone, and
nothing from tokenyard, so every layer (kernels and the pure router runtime included) may import it.

Engines (tokenyard/engines/model):
- TOKENYARD_QUANT_BACKEND: auto (default; empty is auto), cpu, triton or torch replaces the quantised
  matmul's "auto" backend (quantized_linear.py); any other value is a ValueError.
- TOKENYARD_CPU_DECODE_STEP, TOKENYARD_CPU_COMPILE, TOKENYARD_CPU_ONEDNN_LINEAR: auto (default), on or
  off replaces the EngineConfig knob's "auto" (cpu_decode_step, cpu_compile, cpu_onednn_linear;
  model_runner.py); any other value is ignored with a warning (read as auto).
Kernels (tokenyard/kernels):
- TOKENYARD_CPU_ATTENTION: `torch` keeps the torch decode-attention forms; anything else (default
  native) uses the C kernel (cpu_decode_native.py).
- TOKENYARD_MASKED_ARGMAX: `torch` masks a constrained greedy row's logits with torch.where before its
  argmax; anything else (default native) picks the token in C from the grammar's bitmask
  (cpu_masked_argmax.py).


- TOKENYARD_CPU_LORA: `torch` keeps the torch forms of the LoRA adapters' products on a CPU; anything
  else (default native) uses the C kernel (cpu_lora_native.py) for fp32 pools.
- TOKENYARD_NATIVE_MARCH: the -march= value for the C decode step's build; native when unset or empty
  (cpu_decode_step.py).
- TOKENYARD_STEP_SPIN: pause instructions an idle pool worker spins before it sleeps, a whole number
  >= 1; 200,000 when unset or empty; anything else is a ValueError (cpu_decode_step.py).
- TOKENYARD_HUGE_PAGES: off, 0 or false ask for ordinary pages; anything else (default on) asks for
  2 MiB pages (hugepage_arena.py), which an engine core faults in while it imports torch
  (page_reserve.py; also off with TOKENYARD_WEIGHT_CACHE off, where its size hint is kept).
Loading (tokenyard/engines/formats/prepared_cache.py):
- TOKENYARD_WEIGHT_CACHE: off, 0, false or no turn the prepared-weights cache off; anything else
  (default on) keeps it on.
- TOKENYARD_WEIGHT_CACHE_DIR: where its entries live; $XDG_CACHE_HOME/tokenyard/weights (default
  ~/.cache/tokenyard/weights) when unset or empty.
Router runtime (tokenyard/router_models/runtime):
- TOKENYARD_ROUTER_NATIVE: 0, off, false or no choose the numpy feature path; anything else (default 1)
  the C row kernel (native.py).

Values are matched after stripping spaces and, except TOKENYARD_NATIVE_MARCH, case-insensitively.
The gateway's own variables (TOKENYARD_DEV_KEY, TOKENYARD_GIL_SWITCH_MS, TOKENYARD_ENGINE_PROCESS, ...)
are documented in docs/deployment.md beside the config keys they override.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

QUANT_BACKENDS = ("auto", "cpu", "triton", "torch")
DEFAULT_STEP_SPIN = 200_000
_MODES = ("auto", "on", "off")


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


def quant_backend() -> str:
    """TOKENYARD_QUANT_BACKEND: the quantised matmul backend that replaces "auto" ("auto": none).
    An unknown value is a ValueError (a typo must not silently pick a slow backend)."""
    value = _get("TOKENYARD_QUANT_BACKEND", "auto").lower() or "auto"
    if value not in QUANT_BACKENDS:
        raise ValueError(f"TOKENYARD_QUANT_BACKEND must be one of {', '.join(QUANT_BACKENDS)}, got {value!r}")
    return value


def _mode(name: str) -> str:
    """An auto/on/off override; anything else is logged and read as "auto" (the config's own mode wins)."""
    value = _get(name, "auto").lower()
    if value in _MODES:
        return value
    log.warning("ignoring %s=%r (expected auto, on or off)", name, value)
    return "auto"


def cpu_decode_step() -> str:
    """TOKENYARD_CPU_DECODE_STEP: auto, on or off; replaces the cpu_decode_step knob's "auto"."""
    return _mode("TOKENYARD_CPU_DECODE_STEP")


def cpu_compile() -> str:
    """TOKENYARD_CPU_COMPILE: auto, on or off; replaces the cpu_compile knob's "auto"."""
    return _mode("TOKENYARD_CPU_COMPILE")


def cpu_onednn_linear() -> str:
    """TOKENYARD_CPU_ONEDNN_LINEAR: auto, on or off; replaces the cpu_onednn_linear knob's "auto"."""
    return _mode("TOKENYARD_CPU_ONEDNN_LINEAR")


def cpu_attention_native() -> bool:
    """TOKENYARD_CPU_ATTENTION: False when it is `torch` (the torch attention forms), else True."""
    return _get("TOKENYARD_CPU_ATTENTION", "native").lower() != "torch"


def masked_argmax_native() -> bool:
    """TOKENYARD_MASKED_ARGMAX: False when it is `torch` (the torch select), else True."""
    return _get("TOKENYARD_MASKED_ARGMAX", "native").lower() != "torch"


def cpu_lora_native() -> bool:
    """TOKENYARD_CPU_LORA: False when it is `torch` (the torch LoRA forms), else True."""
    return _get("TOKENYARD_CPU_LORA", "native").lower() != "torch"


def native_march() -> str:
    """TOKENYARD_NATIVE_MARCH: the -march= value for the C decode step's build ("native" when unset or empty)."""
    return _get("TOKENYARD_NATIVE_MARCH", "native") or "native"


def step_spin() -> int:
    """TOKENYARD_STEP_SPIN: pause instructions an idle pool worker spins before it sleeps (default 200,000).
    Not a whole number, or below 1: a ValueError."""
    raw = _get("TOKENYARD_STEP_SPIN", "")
    if not raw:
        return DEFAULT_STEP_SPIN
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"TOKENYARD_STEP_SPIN must be a whole number of pause instructions, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"TOKENYARD_STEP_SPIN must be at least 1, got {value}")
    return value


def huge_pages() -> bool:
    """TOKENYARD_HUGE_PAGES: False for off, 0 or false (ordinary pages), else True."""
    return _get("TOKENYARD_HUGE_PAGES", "on").lower() not in ("off", "0", "false")


def router_native() -> bool:
    """TOKENYARD_ROUTER_NATIVE: False for 0, off, false or no (the numpy path), else True."""
    return _get("TOKENYARD_ROUTER_NATIVE", "1").lower() not in ("0", "off", "false", "no")


def weight_cache() -> bool:
    """TOKENYARD_WEIGHT_CACHE: False for off, 0, false or no (no prepared-weights cache), else True."""
    return _get("TOKENYARD_WEIGHT_CACHE", "on").lower() not in ("off", "0", "false", "no")


def weight_cache_dir() -> str:
    """TOKENYARD_WEIGHT_CACHE_DIR: the prepared-weights cache's folder, else
    $XDG_CACHE_HOME/tokenyard/weights (~/.cache/tokenyard/weights)."""
    explicit = _get("TOKENYARD_WEIGHT_CACHE_DIR", "")
    if explicit:
        return os.path.expanduser(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenyard", "weights")
