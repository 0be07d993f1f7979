"""Tokenyard's PyTorch engines. Imports nothing from gateway/ (runs from PYTHONPATH on a GPU box).

The public names are loaded on first use (PEP 562), not when the package is imported: a process that
only needs a light corner of engines/ (a replica's parent whose engine steps in a core process of its
own, the start-up clock, the mock engine) then does not pay torch's import (~1.2-1.5 s on a 2-core VM)
before its core even starts. `from tokenyard.engines import LLM` works as before.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS = {
    "EngineConfig": "tokenyard.engines.core.config",
    "CheckpointError": "tokenyard.engines.core.errors",
    "EngineDeadError": "tokenyard.engines.core.errors",
    "EngineError": "tokenyard.engines.core.errors",
    "RequestError": "tokenyard.engines.core.errors",
    "CompletionOutput": "tokenyard.engines.core.outputs",
    "EngineStats": "tokenyard.engines.core.outputs",
    "RequestOutput": "tokenyard.engines.core.outputs",
    "StepOutput": "tokenyard.engines.core.outputs",
    "SamplingParams": "tokenyard.engines.core.sampling_params",
    "Engine": "tokenyard.engines.runtime.engine",
    "LLM": "tokenyard.engines.runtime.llm",
}

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StepOutput", "EngineStats", "EngineError", "CheckpointError", "RequestError", "EngineDeadError"]

if TYPE_CHECKING:     # what type checkers and IDEs see: the eager imports
    from tokenyard.engines.core.config import EngineConfig
    from tokenyard.engines.core.errors import CheckpointError, EngineDeadError, EngineError, RequestError
    from tokenyard.engines.core.outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.runtime.engine import Engine
    from tokenyard.engines.runtime.llm import LLM


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tokenyard.engines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
