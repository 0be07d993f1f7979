"""Tokenyard's PyTorch engines. Imports nothing from gateway/ (runs from PYTHONPATH on a GPU box)."""
from engines.core.config import EngineConfig
from engines.core.engine import Engine
from engines.core.errors import CheckpointError, EngineDeadError, EngineError, RequestError
from engines.core.llm import LLM
from engines.core.outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from engines.core.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StepOutput", "EngineStats", "EngineError", "CheckpointError", "RequestError", "EngineDeadError"]
