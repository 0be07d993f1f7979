"""The one interface the gateway sees of an engine: a message-shaped backend.

    stream = backend.add_request(request_id, prompt_ids, params, priority=0, cache_salt=None)
    out = await stream.get()          # StepOutput: new token ids, finished, finish reason, usage
    backend.abort(request_id)         # frees the request's KV blocks in the next step
    backend.stats()                   # EngineStats: running, waiting, free KV blocks, block size

Implemented by the in-process `AsyncEngine` (a real or a mock engine core stepped in a thread), and
on the gateway side by the remote engine client and the replica pool, so the gateway's admission,
dispatch and metrics never know which one they drive. `dead` is None while the backend serves, else
why it does not; new requests then raise EngineDeadError.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.sampling_params import SamplingParams


@runtime_checkable
class RequestStreamLike(Protocol):
    async def get(self) -> StepOutput: ...

    def get_nowait(self) -> StepOutput | None: ...


@runtime_checkable
class EngineBackend(Protocol):
    name: str

    @property
    def dead(self) -> str | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_in_flight(self) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStreamLike: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
