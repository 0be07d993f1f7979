"""Tensor parallelism over gloo on the CPU: same tokens and logits as one rank; a dead worker
fails in-flight requests quickly and cleanly; a new engine then serves again."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.errors import CheckpointError, EngineDeadError
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model.model_runner import StepInputs

OPTS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False,
            tp_timeout_s=30.0)


def runner_logits(engine: Engine, token_ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position through the engine's runner (mirrored on TP workers)."""
    seq = Sequence("probe", list(token_ids), SamplingParams(), 0, 0, 0, frozenset())
    bs = engine.blocks.block_size
    engine.blocks.grow(seq.block_table, len(token_ids))
    try:
        n = len(token_ids)
        inputs = StepInputs(list(token_ids), list(range(n)),
                            [seq.block_table[p // bs] * bs + p % bs for p in range(n)], [n], [n],
                            [seq.block_table], list(range(n)))
        return engine.runner.forward(inputs)
    finally:
        engine.blocks.free(seq)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tp2_matches_tp1(checkpoint_dir, name):
    prompts = random_prompts(5, 4, 40, 512, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    logits, tokens = {}, {}
    for tp in (1, 2):
        eng = Engine(checkpoint_dir(name), tensor_parallel_size=tp, **OPTS)
        try:
            logits[tp] = runner_logits(eng, prompts[0])
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            tokens[tp] = run_to_completion(eng)
            assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        finally:
            eng.close()
    ref = logits[1]
    assert logits[2].shape == ref.shape
    err = (logits[2] - ref).abs().max() / ref.abs().max()
    assert err <= 1e-4, f"relative logit error {err:.2e}"
    assert tokens[2] == tokens[1]


def test_tp_size_must_divide_heads(checkpoint_dir):
    with pytest.raises(CheckpointError, match="tensor_parallel_size 3 does not divide num_attention_heads"):
        Engine(checkpoint_dir("llama"), tensor_parallel_size=3, **OPTS)


@pytest.mark.timeout(120)
def test_killed_worker_fails_requests_then_restart_serves(checkpoint_dir):
    path = checkpoint_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    eng = Engine(path, tensor_parallel_size=2, **OPTS)
    try:
        for i, p in enumerate(random_prompts(3, 5, 20, 512, seed=32)):
            eng.add_request(f"r{i}", p, params)
        for _ in range(3):
            eng.step()
        worker = eng.runner.group.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        finished = {}
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    finished[out.request_id] = out
            assert time.monotonic() - t0 < 20, "in-flight requests did not fail within 20 s"
        assert set(finished) == {"r0", "r1", "r2"}
        assert all(o.finish_reason == "error" and "worker 1" in o.error for o in finished.values()), finished
        assert eng.dead is not None
        with pytest.raises(EngineDeadError, match="start a new one"):
            eng.add_request("late", [1, 2, 3], params)
    finally:
        eng.close()
    fresh = Engine(path, tensor_parallel_size=2, **OPTS)
    try:
        fresh.add_request("again", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(run_to_completion(fresh)["again"]) == 4
    finally:
        fresh.close()
