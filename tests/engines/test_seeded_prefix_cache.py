"""A seeded request gives the same output whether its prompt's prefix was cached or not (issue 45.4).

n=3 with a seed, run twice: choice 0 differed and choices 1-2 were identical. Choice 0 (the group's
leader) computed its whole prompt in one chunk on the first run and, on the second, only the tail
after the cached full blocks; the followers computed only the tail both times. The two ways round the
tail's KV and the first token's logits differently (another batch shape), enough to move samples of a
quantised model. A seeded prefill now stops where a cache hit would start, so both ways are one.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine_helpers import run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.block_manager import BlockManager
from tokenyard.engines.core.scheduler import Scheduler, SchedulerConfig
from tokenyard.engines.core.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_small():
    # As the default deployment serves it: int8 weights, bf16 activations, whose rounding differs
    # between one 40-token chunk and a 8-token tail over 32 cached tokens.
    return Engine(ROOT / "models" / "demo-small", quantization="int8", kv_cache_memory=16 << 20, progress=False)


def test_seeded_output_is_the_same_cold_and_warm(demo_small):
    eng = demo_small
    vocab = eng.model_config.vocab_size
    differ = []
    for seed in range(12):
        rnd = random.Random(seed)
        prompt = [rnd.randrange(100, vocab - 2) for _ in range(rnd.randrange(20, 70))]
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        eng.add_request("cold", prompt, params)
        cold = run_to_completion(eng)["cold"]
        hits = eng.stats().prefix_cache_hit_tokens
        eng.add_request("warm", prompt, params)
        warm = run_to_completion(eng)["warm"]
        assert eng.stats().prefix_cache_hit_tokens - hits == (len(prompt) - 1) // 16 * 16  # it was warm
        if cold != warm:
            differ.append((seed, cold, warm))
    # Before the fix seed 2 (a 23-token prompt) differed from its 4th token on this model.
    assert not differ, differ


def _chunks(seq: Sequence, budget: int, prefix_caching: bool = True) -> list[int]:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
                      BlockManager(64, 16, enable_prefix_caching=prefix_caching))
    sched.add(seq)
    sizes = []
    while seq.num_computed_tokens < seq.num_tokens:
        (chunk,) = sched.schedule().chunks
        sizes.append(chunk.num_tokens)
        seq.num_computed_tokens += chunk.num_tokens
    return sizes


def _seq(n: int, seed: int | None) -> Sequence:
    return Sequence("s", list(range(1, n + 1)), SamplingParams(seed=seed), 0, 0, seed or 0, frozenset())


@pytest.mark.parametrize("length, budget, seeded, unseeded", [
    (40, 512, [32, 8], [40]),          # the tail after the cacheable full blocks is a chunk of its own
    (48, 512, [32, 16], [48]),         # a block-aligned prompt: a cache hit recomputes its last block
    (40, 20, [20, 12, 8], [20, 20]),   # chunked by the budget, still stopping at 32
    (10, 512, [10], [10]),             # nothing cacheable: one chunk
])
def test_seeded_prefill_stops_where_a_prefix_hit_would_start(length, budget, seeded, unseeded):
    assert _chunks(_seq(length, seed=5), budget) == seeded
    assert _chunks(_seq(length, seed=None), budget) == unseeded
    assert _chunks(_seq(length, seed=5), budget, prefix_caching=False) == unseeded   # no hit to match


def _group(eng, prompt, late_steps: int) -> list[list[int]]:
    """Three seeded choices of one prompt, as the gateway sends n=3: the followers `late_steps` steps after."""
    seeds = [11, 12, 13]
    got: dict[str, list[int]] = {}

    def add(i):
        eng.add_request(f"c{i}", prompt, SamplingParams(temperature=1.0, seed=seeds[i], max_tokens=12, ignore_eos=True))

    add(0)
    for _ in range(late_steps):
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    add(1)
    add(2)
    for rid, toks in run_to_completion(eng).items():
        got.setdefault(rid, []).extend(toks)
    return [got[f"c{i}"] for i in range(3)]


def test_seeded_choices_repeat_cold_warm_and_however_the_followers_arrive(demo_small):
    vocab = demo_small.model_config.vocab_size
    rnd = random.Random(45)
    for length in (23, 41, 48):
        prompt = [rnd.randrange(100, vocab - 2) for _ in range(length)]
        cold = _group(demo_small, prompt, 0)
        assert len({tuple(c) for c in cold}) == 3          # each choice its own seed
        # Warm; then the followers a step later (the leader's tail computing), as an event loop may send them.
        assert _group(demo_small, prompt, 0) == cold
        assert _group(demo_small, prompt, 1) == cold


def test_a_prompt_being_prefilled_holds_its_copies_then_they_hit_the_cache():
    blocks = BlockManager(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=512), blocks)
    prompt = list(range(1, 41))
    lead = Sequence("lead", prompt, SamplingParams(seed=1), 0, 0, 1, frozenset())
    follow = Sequence("follow", list(prompt), SamplingParams(seed=2), 0, 1, 2, frozenset())
    other = Sequence("other", [7] * 40, SamplingParams(seed=3), 0, 2, 3, frozenset())
    salted = Sequence("salted", prompt, SamplingParams(seed=4), 0, 3, 4, frozenset(), cache_salt="t")
    # Shares lead's first two blocks only (a system prompt): never held, or chat bursts would be admitted
    # one per prefill.
    near = Sequence("near", prompt[:35] + [99] * 5, SamplingParams(seed=5), 0, 4, 5, frozenset())
    for s in (lead, follow, other, salted, near):
        sched.add(s)

    def step() -> dict[str, int]:
        out = sched.schedule()
        for c in out.chunks:
            samples = c.samples
            c.seq.num_computed_tokens += c.num_tokens
            blocks.cache_full_blocks(c.seq)
            if samples:
                c.seq.token_ids.append(0)
        return {c.seq.request_id: c.num_tokens for c in out.chunks}

    # The copy of lead's prompt waits; the others (another prompt, another salt, a shared first block) do not.
    assert step() == {"lead": 32, "other": 32, "salted": 32, "near": 32}
    assert [s.request_id for s in sched.waiting] == ["follow"]
    assert step() == {"lead": 8, "other": 8, "salted": 8, "near": 8}     # lead's first token: its prefill is done
    assert step() == {"lead": 1, "other": 1, "salted": 1, "near": 1, "follow": 8}
    assert follow.num_cached_tokens == 32
