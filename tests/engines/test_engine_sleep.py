"""Engine sleep and wake (tokenyard/engines/runtime/engine_sleep.py): level 1 releases the KV cache's
storage and keeps the weights, level 2 drops the weights too; after either wake the greedy tokens
equal the ones before the sleep (exactly: the same computation on the same weights)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_helpers import run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.sleep_level import SleepLevelError, SleepUnsupported, check_sleep_level
from tokenyard.engines.runtime.engine_sleep import kv_resident_bytes
from tokenyard.nativelib.build import compiler

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "demo-small"
OPTIONS = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=128, max_num_seqs=4, block_size=8, progress=False,
               dtype="float32")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 7, 23], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]


def _generate(engine: Engine, tag: str) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}-{i}", p, GREEDY)
    out = run_to_completion(engine)
    return [out[f"{tag}-{i}"] for i in range(len(PROMPTS))]


def test_level_1_frees_the_kv_storage_keeps_the_weights_and_tokens_match():
    engine = Engine(DEMO, **OPTIONS)
    before = _generate(engine, "a")
    assert engine.blocks.hit_tokens == 0
    _generate(engine, "warm")                                  # the prefix cache now holds the prompts
    caches = engine.runner.kv_caches
    full = kv_resident_bytes(caches)
    assert full > 0
    weights = engine.model.lm_head.weight
    engine.sleep(1)
    assert engine.sleep_level == 1
    assert kv_resident_bytes(caches) == 0                      # every K/V tensor's storage released
    assert engine.model.lm_head.weight is weights             # weights stay
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    hits = engine.blocks.hit_tokens
    phases = engine.wake()
    assert engine.sleep_level == 0 and kv_resident_bytes(caches) <= full   # a CPU cache's pages come back as written
    assert "kv_allocation" in phases
    assert _generate(engine, "b") == before
    assert engine.blocks.hit_tokens == hits                   # the prefix cache was emptied: no stale hits


def test_level_2_drops_the_weights_and_reloads_them():
    engine = Engine(DEMO, **OPTIONS)
    before = _generate(engine, "a")
    engine.sleep(2)
    assert engine.sleep_level == 2 and engine.model is None and engine.runner is None
    phases = engine.wake()
    assert phases["weights_read"] > 0 and engine.model is not None
    assert _generate(engine, "b") == before


def test_level_1_then_2_and_a_request_wakes_a_sleeping_engine():
    engine = Engine(DEMO, **OPTIONS, kv_cache_dtype="int8")   # a quantised cache: codes and scales
    before = _generate(engine, "a")
    engine.sleep(1)
    assert kv_resident_bytes(engine.runner.kv_caches) == 0
    assert engine.sleep(1) == 0.0                             # the same level again: nothing to do
    engine.sleep(2)
    assert engine.model is None
    engine.sleep(1)                                           # lighter than the current one: stays at 2
    assert engine.sleep_level == 2
    assert _generate(engine, "b") == before                   # the first step woke it
    assert engine.sleep_level == 0


def test_sleep_refuses_bad_levels_and_requests_in_flight():
    engine = Engine(DEMO, **OPTIONS)
    for bad in (0, 3, "1", True, None, 1.0):
        with pytest.raises(SleepLevelError, match="level must be 1"):
            engine.sleep(bad)
        with pytest.raises(SleepLevelError):
            check_sleep_level(bad)
    engine.add_request("r", PROMPTS[0], GREEDY)
    with pytest.raises(RequestError, match="in flight"):
        engine.sleep(1)
    engine.step()
    with pytest.raises(RequestError, match="in flight"):
        engine.sleep(1)
    run_to_completion(engine)
    engine.sleep(1)
    assert engine.sleep_level == 1


def test_speculative_engines_cannot_sleep():
    engine = Engine(DEMO, **OPTIONS, speculative_method="ngram", num_speculative_tokens=2)
    with pytest.raises(SleepUnsupported, match="speculative"):
        engine.sleep(1)


@pytest.mark.skipif(compiler() is None, reason="no C compiler: the C decode step cannot be built")
def test_the_c_decode_step_restarts_on_the_new_storage():
    engine = Engine(DEMO, cpu_decode_step="on", **OPTIONS)
    assert engine.runner.native is not None
    before = _generate(engine, "a")
    steps = engine.runner.num_native_steps
    arena = engine.runner.native.arena
    engine.sleep(1)
    assert engine.runner.native is None
    engine.wake()
    assert engine.runner.native is not None
    assert engine.runner.native.arena is arena                # the weights were not copied again
    assert _generate(engine, "b") == before
    assert engine.runner.num_native_steps > steps             # decode ran in the rebuilt C step
    engine.sleep(2)
    engine.wake()
    assert engine.runner.native is not None and _generate(engine, "c") == before
