"""One tiny real request through a new engine before it reports ready (issue 52: the first request
after ready should cost no more than the tenth).

What a first request would otherwise pay: the first prefill through the quantised torch ops
(their first calls), the first step of the C decode step or the compiled graph, the sampler's
first call. `warm_up` runs a 2-token prompt for 2 greedy tokens through `Engine.step` (the path
every request takes) and then puts back every counter the request moved, so stats, metrics and
tests see an engine that has served nothing. It leaves no prefix-cache entry (the sequence never
fills a block) and draws no request seed (its own is fixed).

A failure that kills the engine there (a broken compiled step under `cpu_compile: on`) is raised
from the engine's construction: the replica never reports ready.

Only engines with a fast decode path (the C step, the compiled graph, CUDA graphs) are warmed: the
eager torch path has no first-call cost worth a request, and small test engines stay as they were.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenyard.engines.runtime.engine import Engine

log = logging.getLogger(__name__)

REQUEST_ID = "__tokenyard_warm_up__"
_ENGINE_COUNTERS = ("_arrivals", "_num_steps", "_last_step_tokens", "_last_step_seconds", "_busy_seconds",
                    "_prefill_tokens", "_output_tokens", "_batch_counts")
_RUNNER_COUNTERS = ("num_graph_steps", "num_compiled_steps", "num_native_steps")
MAX_STEPS = 8


def wants_warm_up(engine: Engine) -> bool:
    runner = getattr(engine, "runner", None)
    return (engine.spec is None and engine.micro is None and runner is not None
            and any(getattr(runner, name, None) is not None for name in ("native", "compiled", "graphs")))


def warm_up(engine: Engine) -> float:
    """Run the warm-up request (see the module doc); seconds it took (0.0 when not wanted)."""
    if not wants_warm_up(engine):
        return 0.0
    t0 = time.perf_counter()
    saved = {name: getattr(engine, name) for name in _ENGINE_COUNTERS}
    saved["_batch_counts"] = list(engine._batch_counts)
    runner_saved = {name: getattr(engine.runner, name) for name in _RUNNER_COUNTERS if hasattr(engine.runner, name)}
    blocks = engine.blocks
    block_saved = (blocks.queried_tokens, blocks.hit_tokens, engine.scheduler.num_preemptions)
    try:
        prompt = [int(engine.model_config.bos_token_id or 0), 1]
        try:
            engine.add_request(REQUEST_ID, prompt,
                               SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, seed=0))
        except RequestError as exc:      # e.g. a max_model_len below 4 tokens: nothing to warm with
            log.info("no warm-up request: %s", exc)
            return 0.0
        for _ in range(MAX_STEPS):
            if any(o.request_id == REQUEST_ID and o.finished for o in engine.step()):
                break
        else:
            engine.abort(REQUEST_ID)
            engine.step()
        if engine.dead is not None:   # a broken fast path is a start-up error, not a replica that says ready
            raise RuntimeError(f"the engine failed its warm-up request: {engine.dead}")
    finally:
        for name, value in saved.items():
            setattr(engine, name, value)
        for name, value in runner_saved.items():
            setattr(engine.runner, name, value)
        blocks.queried_tokens, blocks.hit_tokens, engine.scheduler.num_preemptions = block_saved
    return time.perf_counter() - t0
