"""Typed errors raised inside the engines. The HTTP edge (gateway/) maps them to API errors."""


class EngineError(Exception):
    """Base class for engine errors."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint folder is missing a file or tensor, or holds something we cannot run."""


class RequestError(EngineError, ValueError):
    """A request is invalid (bad prompt, bad sampling option). The engine keeps serving others."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine (or one of its workers) has failed; in-flight requests cannot finish."""


class HandoverError(RuntimeError):
    """A disaggregated KV hand-over step that failed: stage is "prefill" (this replica) or "transfer"
    (to the decode side). Here, not in serving/kv_handover.py, so the replica server can catch it
    without importing the KV transfer code (and torch) when it serves no hand-over."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
