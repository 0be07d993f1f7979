"""The online face of one engine: per-request async streams over a step loop off the event loop.

    engine = AsyncEngine(Engine(...), name="demo-small"); await engine.start()
    stream = engine.add_request("r1", prompt_ids, params)
    async for out in stream: ...              # StepOutput, the last one has finished=True
    engine.abort("r1")                        # the engine frees its blocks at its next step

The step loop awaits `engine.step()` on an executor thread, so the event loop keeps serving
HTTP while a batch runs. Torch engines all share `tokenyard.engines.runtime.executor.torch_executor()` (one
thread): on a CPU, two engines stepping at once would fight over the same cores, so they take
turns. Engines that set `uses_torch_executor = False` (the mock engine, whose step sleeps) get
a thread of their own so they never hold up a real one.
The step thread still shares the GIL with the event loop: it gives the GIL up inside every torch
op and C step and must get it back after each, and with Python's 5 ms switch interval a busy event
loop could keep it that long every time. The gateway shortens the interval
(server.gil_switch_interval_ms; tokenyard/gateway/server/server.py), or steps the engine in a process of its
own instead (server.engine_process; tokenyard/engines/serving/engine_process.py).

Constrained requests: `await engine.prepare(params)` before add_request checks the response
format's grammar against its budget in a worker process and compiles it on a thread of its own
(tokenyard/engines/runtime/grammar_gate.py), so neither the event loop nor the step thread ever compiles one;
the engine's grammar set is warmed at start(). Engines without grammars (the mock) skip it.

A step that raises fails every in-flight request with an "error" output (the reader sees it at
once instead of hanging), and aborts them in the engine. After `max_consecutive_failures`
failing steps in a row the engine is declared dead: new requests raise EngineDeadError.

Sleep (tokenyard/engines/runtime/async_sleep.py): `await engine.sleep(level)` drains and releases
the KV cache (1) or the weights too (2); requests that arrive meanwhile wait for the wake the loop
starts for them; `await engine.wake()` wakes it at once.

Restart: given a `factory` (a function that builds a fresh engine; the gateway passes one), an
engine whose step raised, or that reports itself dead (`engine.dead`, e.g. a tensor-parallel
worker died and tokenyard.engines.Engine failed every request with an error), is rebuilt at once: the old
one is closed (`close()`, if it has one) and `factory()` runs on the step executor. While that
runs new requests raise EngineDeadError (the gateway answers 503). A build that fails is retried
up to `max_restart_attempts` times with exponential backoff from `restart_backoff_s` (capped at
30 s); if every attempt fails the engine stays dead. `num_restarts` counts rebuilds that worked.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.outputs import EngineStats, StepOutput
from tokenyard.engines.core.prompt_packing import pack
from tokenyard.engines.core.sampling_params import SamplingParams
from tokenyard.engines.runtime.async_sleep import SleepControl
from tokenyard.engines.runtime.executor import torch_executor
from tokenyard.engines.runtime.grammar_gate import GrammarGate
from tokenyard.engines.runtime.grammar_worker import GrammarWorker

log = logging.getLogger(__name__)


class EngineCore(Protocol):
    """The narrow interface both tokenyard.engines.Engine and tokenyard.engines.serving.mock_engine.MockEngine provide."""

    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def has_unfinished(self) -> bool: ...


class RequestStream:
    """The outputs of one request, in order; iteration ends after the finished output."""

    __slots__ = ("request_id", "_queue", "finished", "retryable")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self.finished = False
        # Set with an "error" end when no token was computed for it (a wake that failed): a replica
        # pool may run it on another replica without the client seeing a thing.
        self.retryable = False

    def put(self, out: StepOutput) -> None:
        self._queue.put_nowait(out)

    async def get(self) -> StepOutput:
        out = await self._queue.get()
        if out.finished:
            self.finished = True
        return out

    def get_nowait(self) -> StepOutput | None:
        try:
            out = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None
        if out.finished:
            self.finished = True
        return out

    async def __aiter__(self) -> AsyncIterator[StepOutput]:
        while not self.finished:
            yield await self.get()


def deliver(streams: dict[str, RequestStream], outputs: list[StepOutput]) -> None:
    """Hand each output to its request's stream; a finished request leaves `streams`. Outputs of
    requests no longer there (aborted by their reader: nobody is listening) are dropped."""
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None:
            continue
        if out.finished:
            del streams[out.request_id]
        stream.put(out)


def fail_streams(streams: dict[str, RequestStream], message: str, retryable: bool = False) -> None:
    """End every stream with an "error" output (its reader sees it at once instead of hanging)."""
    for rid, stream in streams.items():
        stream.retryable = retryable
        stream.put(StepOutput(rid, [], finished=True, finish_reason="error", error=message))


async def cancel_task(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


T = TypeVar("T")


async def with_backoff(name: str, attempts: int, backoff_s: float, build: Callable[[], Awaitable[T]]) -> tuple[T | None, int]:
    """await build() until it works, at most `attempts` times, sleeping backoff_s * 2**i (capped at
    30 s) after the i-th failure; (its result, or None when every attempt failed; failed attempts)."""
    for attempt in range(attempts):
        try:
            return await build(), attempt
        except Exception:  # noqa: BLE001 - retried with backoff
            log.exception("engine %s: restart attempt %d failed", name, attempt + 1)
            await asyncio.sleep(min(30.0, backoff_s * 2 ** attempt))
    return None, attempts


class AsyncEngine(SleepControl):
    def __init__(self, engine: EngineCore, name: str = "engine", executor: Executor | None = None,
                 max_consecutive_failures: int = 3, factory: Callable[[], EngineCore] | None = None,
                 max_restart_attempts: int = 5, restart_backoff_s: float = 0.5) -> None:
        self.engine = engine
        self.name = name
        self._own_executor = executor is None and not getattr(engine, "uses_torch_executor", True)
        if executor is not None:
            self._executor = executor
        elif self._own_executor:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tokenyard-{name}")
        else:
            self._executor = torch_executor()
        self._streams: dict[str, RequestStream] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stats = engine.stats()
        self._max_failures = max_consecutive_failures
        self.dead: str | None = None      # why the engine was declared dead
        self.num_failed_steps = 0
        self._factory = factory           # builds a replacement engine; None: no restarts
        self._max_restart_attempts = max_restart_attempts
        self._restart_backoff_s = restart_backoff_s
        self.num_restarts = 0             # engines rebuilt after a failure
        self.num_failed_restarts = 0      # attempts to rebuild that raised
        self.grammar_gate = self._grammar_gate(engine)
        self._waking: asyncio.Future[dict[str, float]] | None = None   # the wake under way
        self.last_wake_s: float | None = None                          # seconds the latest wake took
        self.last_wake_phases: dict[str, float] = {}

    def _grammar_gate(self, engine: EngineCore) -> GrammarGate | None:
        """Checks and builds grammars for engines that compile them (tokenyard.engines.Engine), else None."""
        model_dir = getattr(engine, "grammar_model_dir", None)
        if model_dir is None:
            return None
        worker = GrammarWorker(model_dir, engine.grammar_budget, self.name)
        # build/warm look the engine up each time: a restart replaces it.
        return GrammarGate(worker, build=lambda fmt: self.engine.prepare_grammar(fmt),
                           warm=lambda: self.engine.warm_grammars(), name=self.name,
                           idle=lambda: not self._streams)    # warm in the first lull, not beside requests

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def embedding_size(self) -> int | None:
        """The length of embed()'s vectors (the model's hidden size); None when the engine computes none."""
        cfg = getattr(self.engine, "model_config", None)
        return cfg.hidden_size if cfg is not None and hasattr(self.engine, "embed") else None

    @property
    def startup_phases(self) -> dict[str, float]:
        """Seconds per phase of building the engine core (core/startup_phases.py); {} when it keeps none."""
        phases = getattr(self.engine, "startup_phases", None)
        return phases.as_dict() if phases is not None else {}

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"engine-loop-{self.name}")
            if self.grammar_gate is not None:
                await self.grammar_gate.start()

    async def stop(self) -> None:
        """Abort everything in flight and stop the loop (the engine object stays usable)."""
        for rid in list(self._streams):
            self.abort(rid)
        await cancel_task(self._task)
        self._task = None
        if self._own_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.grammar_gate is not None:
            self.grammar_gate.close()

    async def prepare(self, params: SamplingParams) -> None:
        """Make the request's grammar ready off the event loop; GrammarError when it is refused.
        Call add_request right after (no await between), as the gate's docstring says."""
        if self.grammar_gate is not None and params.response_format is not None:
            await self.grammar_gate.prepare(params.response_format)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | dict | None = None,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Validate and queue; raises RequestError (bad input) or EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        if self._task is None:
            raise EngineDeadError(f"engine {self.name} is not started")
        stream = RequestStream(request_id)
        self.engine.add_request(request_id, prompt_token_ids, params, priority, cache_salt)
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends with an "abort" output (waking a waiting reader) and
        gets nothing more; the engine frees the request's blocks at its next step."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.engine.abort(request_id)
            stream.put(StepOutput(request_id, [], finished=True, finish_reason="abort"))
            if self._wake is not None:
                self._wake.set()

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """Embeddings of token-id prompts (tokenyard.engines.Engine.embed), computed on the step executor
        between steps, a batch of at most max_num_batched_tokens tokens at a time: a long list takes
        turns with the running requests' steps instead of holding them up. Every prompt is checked
        first (on a worker thread), so a bad one fails the call before anything runs. RequestError
        when the engine computes none (the mock) or a prompt is bad; EngineDeadError when it is down."""
        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        if not hasattr(self.engine, "embed"):
            raise RequestError(f"engine {self.name} does not compute embeddings")
        prompts = await asyncio.to_thread(self.engine.check_embed, prompts)
        loop = asyncio.get_running_loop()
        out: list[list[float]] = []
        for idx in pack(prompts, self.engine.config.max_num_batched_tokens):
            # self.engine each time: a restart between batches replaces it (the same checkpoint).
            out += await loop.run_in_executor(self._executor, self.engine.embed, [prompts[i] for i in idx])
        return out

    def stats(self) -> EngineStats:
        """Taken on the step thread after the latest step, so it never races the scheduler."""
        return self._stats

    # -- LoRA adapters at run time (tokenyard/engines/lora/adapter_errors.py says what each error means) --
    async def load_adapter(self, name: str, path: str) -> dict:
        """Load an adapter on the step executor, between steps; the engine's load_adapter errors pass through."""
        info = await self._between_steps("load_adapter", name, path)
        return info

    async def unload_adapter(self, name: str) -> None:
        """Unload on the step executor; AdapterConflict while requests use the adapter."""
        await self._between_steps("unload_adapter", name)

    async def _between_steps(self, method: str, *args: object) -> object:
        from tokenyard.engines.lora.adapter_errors import AdapterUnsupported

        if self.dead is not None:
            raise EngineDeadError(f"engine {self.name} is down: {self.dead}")
        fn = getattr(self.engine, method, None)
        if fn is None:
            raise AdapterUnsupported(f"engine {self.name} cannot load or unload LoRA adapters")
        engine = self.engine
        result = await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        if self.engine is engine:      # the stats carry the adapters' names (a restart replaced the engine: its own)
            self._stats = await asyncio.get_running_loop().run_in_executor(self._executor, engine.stats)
        return result

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            if not self._streams and not self.engine.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.sleep_level:     # requests came for a sleeping engine: they wait for the wake
                try:
                    await self.wake()
                except Exception:  # noqa: BLE001 - handled in wake(): requests failed, restarted or dead
                    if self.dead is not None:
                        return
                continue
            try:
                outputs, self._stats = await loop.run_in_executor(self._executor, self._step)
                failures = 0
            except Exception as e:  # noqa: BLE001 - any failure must reach the waiting readers
                failures += 1
                self.num_failed_steps += 1
                log.exception("engine %s: step failed", self.name)
                self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                if self._factory is not None:   # the engine's state is unknown: replace it
                    if not await self._restart(f"step raised {type(e).__name__}: {e}"):
                        return
                    failures = 0
                    continue
                if failures >= self._max_failures:
                    self.dead = f"{failures} steps failed in a row, the last with {type(e).__name__}"
                    log.error("engine %s declared dead: %s", self.name, self.dead)
                    return
                await asyncio.sleep(0.01 * failures)  # do not spin on a broken engine
                continue
            deliver(self._streams, outputs)
            inner_dead = getattr(self.engine, "dead", None)
            if inner_dead and self._factory is not None:
                # The engine failed its requests itself (e.g. a tensor-parallel worker died).
                self._fail_all(f"engine failed: {inner_dead}")
                if not await self._restart(str(inner_dead)):
                    return

    async def _restart(self, why: str) -> bool:
        """Replace the engine with factory()'s; False when every attempt failed (the engine stays dead)."""
        loop = asyncio.get_running_loop()
        self.dead = f"restarting after: {why}"
        log.error("engine %s failed (%s); restarting it", self.name, why)
        old = self.engine
        close = getattr(old, "close", None)
        if close is not None:
            try:
                await loop.run_in_executor(self._executor, close)
            except Exception:  # noqa: BLE001 - the old engine is broken anyway
                log.warning("engine %s: closing the failed engine raised", self.name, exc_info=True)

        async def build() -> tuple[EngineCore, EngineStats]:
            fresh = await loop.run_in_executor(self._executor, self._factory)
            return fresh, await loop.run_in_executor(self._executor, fresh.stats)

        built, failures = await with_backoff(self.name, self._max_restart_attempts, self._restart_backoff_s, build)
        self.num_failed_restarts += failures
        if built is None:
            self.dead = f"{why}; {self._max_restart_attempts} restart attempts failed"
            log.error("engine %s declared dead: %s", self.name, self.dead)
            return False
        self.engine, self._stats = built
        self.num_restarts += 1
        self.dead = None
        log.warning("engine %s restarted (%d restart(s) so far)", self.name, self.num_restarts)
        return True

    def _step(self) -> tuple[list[StepOutput], EngineStats]:
        outputs = self.engine.step()
        return outputs, self.engine.stats()

    def _fail_all(self, message: str, retryable: bool = False) -> None:
        streams, self._streams = self._streams, {}
        for rid in streams:
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already failing; readers come first
                pass
        fail_streams(streams, message, retryable)
