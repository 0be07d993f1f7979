"""Pipeline parallelism over gloo on the CPU (pipeline_parallel_size=2, a 3-layer random Llama split
2 + 1): the same logits and greedy tokens as one process, with micro-batches in flight, and with
chunked prefill, prefix caching, preemption, priorities and abort all exercised."""
from __future__ import annotations

import pytest

from tests.engine_helpers import random_prompts
from tests.engines.test_tensor_parallel import runner_logits
from tokenyard.bench.random_checkpoint import build_random_checkpoint
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.pp.stage_split import stage_layers

OPTS = dict(dtype="float32", kv_cache_memory=4 << 20, max_num_batched_tokens=64, progress=False, tp_timeout_s=30.0)
LOGIT_TOL = 1e-4   # relative, as the tensor-parallel parity test


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    return build_random_checkpoint(tmp_path_factory.mktemp("pp") / "llama3", "llama", num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, seed=5)


def test_stage_layers_are_contiguous_and_balanced():
    assert stage_layers(3, 2) == [range(0, 2), range(2, 3)]
    assert stage_layers(8, 4) == [range(2 * s, 2 * s + 2) for s in range(4)]
    assert stage_layers(2, 1) == [range(0, 2)]
    with pytest.raises(CheckpointError, match="pipeline_parallel_size 3 exceeds the model's 2 decoder layers"):
        stage_layers(2, 3)


@pytest.mark.parametrize("bad, match", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
    (dict(pipeline_parallel_size="2"), "pipeline_parallel_size must be a positive integer"),
    (dict(pipeline_parallel_size=2, speculative_method="ngram"),
     "speculative_method ngram is not supported with pipeline_parallel_size > 1"),
])
def test_bad_config_is_refused(three_layers, bad, match):
    with pytest.raises(ValueError, match=match):
        Engine(three_layers, **OPTS, **bad)


def test_more_stages_than_layers_fails_before_spawning(three_layers):
    with pytest.raises(CheckpointError, match="exceeds the model's 3 decoder layers"):
        Engine(three_layers, pipeline_parallel_size=4, **OPTS)


# One engine of each kind for the module (a P=2 engine spawns a process: seconds under load). The
# KV cache is small (12 blocks of 16 tokens) so that the feature test preempts; prefill chunks are
# at most 24 tokens.
PAIR_OPTS = dict(OPTS, kv_cache_memory=12 * 12288, long_prefill_token_threshold=24)


@pytest.fixture(scope="module")
def engines(three_layers):
    made: dict[int, Engine] = {}
    try:
        for pp in (1, 2):
            made[pp] = Engine(three_layers, pipeline_parallel_size=pp, **PAIR_OPTS)
        yield made
    finally:
        for eng in made.values():
            eng.close()


def run_tracking(engine: Engine, abort_after: int = 0) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Tokens and finish reason per request, and the most micro-batches seen in flight at once.
    abort_after > 0: abort "r5" after that many steps."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    most = steps = 0
    while engine.has_unfinished():
        steps += 1
        if steps == abort_after:
            engine.abort("r5")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if engine.micro is not None:
            most = max(most, engine.micro.num_in_flight)
            in_flight = [c.seq for f in engine.micro.flights for c in f.batch.chunks]
            assert len(in_flight) == len(set(in_flight)), "a sequence is in two in-flight batches"
    return tokens, reasons, most


def test_pp2_matches_single_process(engines):
    prompts = random_prompts(6, 4, 30, 512, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    logits, tokens, in_flight = {}, {}, {}
    # Each stage holds KV for its own layers only: rank 0 has 2 of the 3 (same block count).
    assert len(engines[2].runner.kv_caches) == 2 and len(engines[1].runner.kv_caches) == 3
    for pp, eng in engines.items():
        logits[pp] = runner_logits(eng, prompts[0])
        before = eng.stats().output_tokens
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        tokens[pp], _, in_flight[pp] = run_tracking(eng)
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
        assert eng.stats().output_tokens - before == 36
    err = (logits[2] - logits[1]).abs().max() / logits[1].abs().max()
    assert logits[2].shape == logits[1].shape and err <= LOGIT_TOL, f"relative logit error {err:.2e}"
    assert tokens[2] == tokens[1]
    assert in_flight[2] == 2   # the stages overlapped: two micro-batches in the pipeline at once


def test_pp2_scheduling_features_keep_tokens(engines):
    """12 KV blocks for 6 requests of up to 84 tokens (preemption), a shared 32-token prefix
    computed before the others arrive (prefix caching), prefill chunks of at most 24 tokens,
    mixed priorities, and one abort mid-stream."""
    shared = random_prompts(1, 32, 32, 512, seed=43)[0]
    prompts = [shared + tail for tail in random_prompts(6, 3, 12, 512, seed=44)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for pp, eng in engines.items():
        before = eng.stats()
        eng.add_request("p0", prompts[0], params)
        first, _, _ = run_tracking(eng)
        for i, p in enumerate(prompts[1:], start=1):
            eng.add_request(f"r{i}", p, params, priority=i % 3)
        tokens, reasons, _ = run_tracking(eng, abort_after=10 if pp == 2 else 0)
        after = eng.stats()
        results[pp] = dict(tokens, p0=first["p0"]), reasons, after.num_preemptions - before.num_preemptions, \
            after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    (ref, _, ref_preempted, _), (got, reasons, preempted, hits) = results[1], results[2]
    assert reasons["r5"] == "abort"
    assert all(reasons[f"r{i}"] == "length" for i in range(1, 5))
    for rid in ["p0"] + [f"r{i}" for i in range(1, 5)]:
        assert got[rid] == ref[rid], rid
    # The aborted request's tokens up to the abort are the reference's (the abort may come first).
    assert got.get("r5", []) == ref["r5"][:len(got.get("r5", []))]
    assert preempted > 0 and ref_preempted > 0, (preempted, ref_preempted)
    assert hits >= 4 * 32
