"""Tokenyard's PyTorch engines. Imports nothing from gateway/ (runs from PYTHONPATH on a GPU box)."""
from .config import EngineConfig
from .engine import Engine
from .errors import CheckpointError, EngineDeadError, EngineError, RequestError
from .llm import LLM
from .outputs import CompletionOutput, EngineStats, RequestOutput, StepOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StepOutput", "EngineStats", "EngineError", "CheckpointError", "RequestError", "EngineDeadError"]
