"""One tiny real request through a new engine before it reports ready (issue 52: the first request
after ready should cost no more than the tenth).

What a first request would otherwise pay: the first prefill through the quantised torch ops
(their first calls), the first steps of the C decode step or the compiled graph, the sampler's
first call. `warm_up` runs an 8-token prompt for 7 greedy tokens through `Engine.step` (the path
every request takes) and then puts back every counter the request moved, so stats, metrics and
tests see an engine that has served nothing. It leaves no prefix-cache entry (the sequence never
fills a block) and draws no request seed (its own is fixed).

It runs on the thread that builds the engine; a replica steps on the torch executor's thread. A
second run there before ready was tried and taken out: in-process a new thread's first request was
5-15 ms slower unless warmed there, but in a replica it did not bring the first request down to the
tenth and cost 0.08 s of ready time (bench/RESULTS.md, "Issue 52, what was left").

A failure that kills the engine there (a broken compiled step under `cpu_compile: on`) is raised
from the engine's construction: the replica never reports ready.

Only engines with a fast decode path (the C step, the compiled graph, CUDA graphs) are warmed: the
eager torch path has no first-call cost worth a request, and small test engines stay as they were.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.sampling_params import SamplingParams

# The engine (tokenyard/engines/runtime/engine.py) calls this while it builds itself; it is typed Any
# here so this module does not import engine.py back.
Engine = Any

log = logging.getLogger(__name__)

REQUEST_ID = "__tokenyard_warm_up__"
_ENGINE_COUNTERS = ("_arrivals", "_num_steps", "_last_step_tokens", "_last_step_seconds", "_busy_seconds",
                    "_prefill_tokens", "_output_tokens", "_batch_counts")
_RUNNER_COUNTERS = ("num_graph_steps", "num_compiled_steps", "num_native_steps")
# The warm-up request's shape: a prompt of several tokens (a 2-token one left the first real prefill
# of a longer prompt and the first decode steps after it about 20 ms slower than later ones on
# SmolLM2: bench/RESULTS.md, "Issue 52, what was left") and a few decode steps; prompt + output
# stay within one KV block, so no prefix-cache entry is left (shorter where the block or the
# context is smaller).
PROMPT_TOKENS = 8
MAX_TOKENS = 7
MAX_STEPS = 16


def request_shape(block_size: int, max_model_len: int) -> tuple[int, int]:
    """(prompt tokens, output tokens) of the warm-up request: PROMPT_TOKENS and MAX_TOKENS where they
    fit, else less, so that the sequence fills no KV block (no prefix-cache entry) and fits the context.
    Where it can, the prompt gives way first: two output tokens are at least one decode step, the fast
    path the warm-up is for (the prefill alone never runs it)."""
    total = max(2, min(PROMPT_TOKENS + MAX_TOKENS, block_size - 1, max_model_len))
    if total < 3:
        return 1, 1
    n_out = min(MAX_TOKENS, max(2, total - PROMPT_TOKENS))
    return total - n_out, n_out


def wants_warm_up(engine: Engine) -> bool:
    runner = getattr(engine, "runner", None)
    return (getattr(engine, "spec", None) is None and getattr(engine, "micro", None) is None and runner is not None
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
        n_prompt, n_out = request_shape(engine.config.block_size, engine.max_model_len)
        prompt = [int(engine.model_config.bos_token_id or 0)] + list(range(1, n_prompt))
        try:
            engine.add_request(REQUEST_ID, prompt,
                               SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True, seed=0))
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
