"""Continuous batching: batch invariance, block accounting, bad input."""
import pytest

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import LLM, Engine, RequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return Engine(checkpoint_dir("llama"), kv_cache_memory=16 << 20, max_num_batched_tokens=128, progress=False)


def _alone(engine, prompt, params):
    engine.add_request("alone", prompt, params)
    return run_to_completion(engine)["alone"]


def test_greedy_batch_invariance_with_staggered_arrivals(engine):
    prompts = random_prompts(16, 2, 90, engine.model_config.vocab_size, seed=21)
    expected = [_alone(engine, p, GREEDY) for p in prompts]
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        # Two new requests every third step: arrivals land mid-prefill and mid-decode of others.
        if pending and step % 3 == 0:
            for _ in range(2):
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(f"r{i}", p, GREEDY)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, exp in enumerate(expected):
        assert got[f"r{i}"] == exp, f"request {i} changed when batched"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_seeded_sampling_is_batch_invariant(engine):
    vocab = engine.model_config.vocab_size
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = random_prompts(1, 30, 30, vocab, seed=4)[0]
    alone = _alone(engine, prompt, seeded)
    assert alone == _alone(engine, prompt, seeded)  # reproducible at all
    others = random_prompts(10, 5, 60, vocab, seed=8)
    for i, p in enumerate(others[:5]):
        engine.add_request(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
    engine.step()
    engine.add_request("seeded", prompt, seeded)
    for i, p in enumerate(others[5:]):
        engine.add_request(f"p{i}", p, GREEDY)
    assert run_to_completion(engine)["seeded"] == alone
    # Different seeds give different samples (the seed is really used).
    other = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert _alone(engine, prompt, other) != alone


def test_block_accounting(engine):
    bs = engine.blocks.block_size
    for i, p in enumerate(random_prompts(12, 1, 100, engine.model_config.vocab_size, seed=9)):
        engine.add_request(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=5 + 3 * i, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            allocated = len(seq.block_table) * bs
            assert 0 <= allocated - seq.num_computed_tokens < bs
        owned = [b for s in engine.scheduler.running for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert engine.blocks.num_free_blocks + len(owned) == engine.blocks.num_blocks
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(c == 0 for c in engine.blocks.pool.ref_counts)


def test_abort_frees_blocks(engine):
    prompts = random_prompts(4, 40, 60, engine.model_config.vocab_size, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, GREEDY)
    engine.step()
    engine.abort("a1")
    engine.abort("no-such-request")  # ignored
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a1"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    done = run_to_completion(engine)
    assert "a1" not in done and all(len(done[f"a{i}"]) > 0 for i in (0, 2, 3))
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_preemption_under_tiny_kv_keeps_outputs(checkpoint_dir, engine):
    prompts = random_prompts(8, 20, 40, engine.model_config.vocab_size, seed=17)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [_alone(engine, p, params) for p in prompts]
    # 16 blocks of 16 tokens cannot hold 8 sequences of up to 80 tokens: forces preemption.
    small = Engine(checkpoint_dir("llama"), kv_cache_memory=16 * engine.blocks.block_size * 2 * 2 * 2 * 16 * 4,
                   progress=False)
    assert small.blocks.num_blocks == 16
    for i, p in enumerate(prompts):
        small.add_request(f"s{i}", p, params)
    got = run_to_completion(small)
    assert small.stats().num_preemptions > 0
    assert [got[f"s{i}"] for i in range(8)] == expected
    assert small.blocks.num_free_blocks == small.blocks.num_blocks


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5] * 2000), "max_model_len"),
    (dict(prompt=[5, 10**9]), "not an integer id"),
    (dict(params=dict(max_tokens=0)), "max_tokens"),
    (dict(params=dict(max_tokens=-3)), "max_tokens"),
    (dict(params=dict(top_p=0.0)), "top_p"),
    (dict(params=dict(top_p=1.5)), "top_p"),
    (dict(params=dict(temperature=-0.1)), "temperature"),
    (dict(params=dict(bogus_option=1)), "unknown sampling option"),
])
def test_bad_input_is_a_clear_error_and_engine_keeps_serving(engine, kwargs, message):
    engine.add_request("good", [5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", kwargs.get("prompt", [5, 6, 7]), kwargs.get("params", GREEDY))
    assert len(run_to_completion(engine)["good"]) == GREEDY.max_tokens
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_sampling_params_validate_on_construction():
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1)


def test_duplicate_request_id_refused(engine):
    engine.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("dup", [1, 2, 3], GREEDY)
    run_to_completion(engine)


def test_stop_token_ids_and_eos(engine):
    prompt = [5, 6, 7, 8]
    free = _alone(engine, prompt, GREEDY)
    stop_at = free[3]
    first = free.index(stop_at)
    out = LLMStub(engine).run(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_at]))
    assert out[0] == free[:first + 1] and out[1] == "stop"


class LLMStub:
    """Drive an existing engine the way LLM.generate does, keeping the finish reason."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, prompt, params):
        self.engine.add_request("stub", prompt, params)
        tokens, reason = [], None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens.extend(out.new_token_ids)
                reason = out.finish_reason or reason
        return tokens, reason


def test_llm_generate_shapes(checkpoint_dir):
    llm = LLM(checkpoint_dir("qwen2"), kv_cache_memory=8 << 20)
    prompts = random_prompts(3, 4, 9, 512, seed=1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 5, 9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 5, 9]
    assert [o.prompt_token_ids for o in outs] == prompts
    single = llm.generate(prompts[2], params[2], use_tqdm=False)  # one prompt, not a list of them
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    with pytest.raises(RequestError, match="sampling_params"):
        llm.generate(prompts, params[:2], use_tqdm=False)
    assert not llm.engine.has_unfinished()
