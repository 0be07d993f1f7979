"""Embeddings from an engine stepped in a process of its own (engine_process.py): both ends of the
("embed", token, prompts) message.

Why here and not refused: the engine process is the default for torch engines, and an engine that
serves /v1/embeddings (a deployment's `embeddings: true`) would otherwise have to stay in-process and
share the GIL with the gateway's event loop. The core computes the vectors as an in-process engine
does (Engine.embed: mean-pooled final hidden states, L2-normalised), between steps, one batch of at most
max_num_batched_tokens tokens per turn of its loop, so a long list takes turns with the running
requests' steps instead of holding them up.

Messages: parent to core ("embed", token, prompts); core to parent ("embedded", token, vectors, None)
or ("embedded", token, None, message) when the prompts are refused (a RequestError on the parent's
side, a 400 at the gateway) or the engine raised. A core that dies with embeddings pending fails them
with EngineDeadError (a 503: the call is safe to repeat, nothing was billed).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenyard.engines.core.errors import EngineDeadError, RequestError
from tokenyard.engines.core.prompt_packing import pack

log = logging.getLogger(__name__)


def embedding_size(engine: Any) -> int | None:
    """The length of the engine's embedding vectors (its hidden size); None when it computes none."""
    cfg = getattr(engine, "model_config", None)
    return cfg.hidden_size if cfg is not None and hasattr(engine, "embed") else None


# -- the core's side ----------------------------------------------------------------------------
@dataclass
class _Job:
    reply: Callable[[tuple], Any]
    token: int
    prompts: list[list[int]]
    batches: deque[list[int]]
    vectors: list[list[float]] = field(default_factory=list)


class CoreEmbeddings:
    """Embedding requests waiting in the core, computed one batch per turn of its loop."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.jobs: deque[_Job] = deque()

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def submit(self, reply: Callable[[tuple], Any], token: int, prompts: Any) -> None:
        """Check the prompts now (a refusal is answered at once) and queue the work."""
        if not hasattr(self.engine, "embed"):
            reply(("embedded", token, None, "this engine does not compute embeddings"))
            return
        try:
            prompts = self.engine.check_embed(prompts)
        except (RequestError, ValueError, TypeError) as e:
            reply(("embedded", token, None, str(e)))
            return
        batches = deque(pack(prompts, self.engine.config.max_num_batched_tokens))
        self.jobs.append(_Job(reply, token, prompts, batches))

    def run_one(self) -> None:
        """Compute the next batch of the oldest job; answer the job when its last batch is done."""
        job = self.jobs[0]
        idx = job.batches.popleft()
        try:
            job.vectors += self.engine.embed([job.prompts[i] for i in idx])
        except Exception as e:  # noqa: BLE001 - one bad call must not end the core; the caller hears why
            log.exception("engine process: embeddings failed")
            self.jobs.popleft()
            job.reply(("embedded", job.token, None, f"{type(e).__name__}: {e}"))
            return
        if not job.batches:
            self.jobs.popleft()
            job.reply(("embedded", job.token, job.vectors, None))

    def drop(self, reply: Callable[[tuple], Any]) -> None:
        """A gateway process went away: its jobs are not computed."""
        self.jobs = deque(j for j in self.jobs if j.reply != reply)


# -- the parent's side (a mixin of EngineProcess) -------------------------------------------------
class ProcessEmbed:
    _embedding_size: int | None = None
    _embed_waiting: dict[int, asyncio.Future] | None = None
    _embed_tokens = itertools.count()

    @property
    def embedding_size(self) -> int | None:
        """The length of embed()'s vectors (the model's hidden size); None when the engine computes none."""
        return self._embedding_size

    async def embed(self, prompts: list[list[int]]) -> list[list[float]]:
        """As AsyncEngine.embed: a unit vector per token-id prompt. RequestError for bad prompts or an
        engine that computes none; EngineDeadError when the core is down or dies before answering."""
        if self.dead is not None or self._writer is None:      # type: ignore[attr-defined]
            raise EngineDeadError(f"engine {self.name} is down: {self.dead or 'not started'}")  # type: ignore[attr-defined]
        if self._embedding_size is None:
            raise RequestError(f"engine {self.name} does not compute embeddings")  # type: ignore[attr-defined]
        if self._embed_waiting is None:
            self._embed_waiting = {}
        token = next(self._embed_tokens)
        fut = asyncio.get_running_loop().create_future()
        self._embed_waiting[token] = fut
        self._send(("embed", token, [list(p) for p in prompts]))   # type: ignore[attr-defined]
        try:
            return await fut
        finally:
            self._embed_waiting.pop(token, None)

    def _embedded(self, msg: tuple) -> None:
        """("embedded", token, vectors, error) from the core."""
        fut = (self._embed_waiting or {}).get(msg[1])
        if fut is None or fut.done():
            return
        if msg[3] is not None:
            fut.set_exception(RequestError(msg[3]))
        else:
            fut.set_result(msg[2])

    def _embeds_gone(self, why: str) -> None:
        for fut in (self._embed_waiting or {}).values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"engine {self.name}: {why}"))  # type: ignore[attr-defined]
