"""Tokenyard's PyTorch engines. Imports nothing from gateway/ (runs from PYTHONPATH on a GPU box)."""
from tokenyard.engines.core.config import EngineConfig
from tokenyard.engines.core.errors import CheckpointError, EngineDeadError, EngineError, RequestError
from tokenyard.engines.core.outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.engine import Engine
from tokenyard.engines.runtime.llm import LLM

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StepOutput", "EngineStats", "EngineError", "CheckpointError", "RequestError", "EngineDeadError"]
