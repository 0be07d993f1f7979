"""Typed errors raised inside the engines. The HTTP edge (gateway/) maps them to API errors."""


class EngineError(Exception):
    """Base class for engine errors."""


class CheckpointError(EngineError, ValueError):
    """A checkpoint folder is missing a file or tensor, or holds something we cannot run."""


class RequestError(EngineError, ValueError):
    """A request is invalid (bad prompt, bad sampling option). The engine keeps serving others."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine (or one of its workers) has failed; in-flight requests cannot finish."""
