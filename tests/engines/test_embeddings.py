"""Embeddings from the built-in engine (Engine.embed, AsyncEngine.embed, LLM.embed): the final hidden
states mean-pooled over the prompt and L2-normalised, from a forward that leaves the KV cache alone."""
import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine_helpers import random_prompts
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.runtime.async_engine import AsyncEngine

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo-small"
TEXTS = ["hello world", "the cat sat on the mat", "a much longer sentence " * 12, "x"]


@pytest.fixture(scope="module")
def llm():
    with LLM(DEMO, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=64,
             progress=False) as m:
        yield m


def test_shape_norm_and_determinism(llm):
    got = np.array(llm.embed(TEXTS))
    assert got.shape == (len(TEXTS), llm.engine.model_config.hidden_size) and got.dtype == np.float64
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(np.array(llm.embed(TEXTS)), got)          # deterministic, bit for bit
    # Different texts give different vectors (not one constant direction).
    assert np.abs(got[0] - got[1]).max() > 1e-2


def test_batched_equals_one_at_a_time(llm):
    # max_num_batched_tokens 64: the longer prompt runs in a batch of its own, the others together.
    batched = np.array(llm.embed(TEXTS))
    alone = np.array([llm.embed(t)[0] for t in TEXTS])
    assert np.abs(batched - alone).max() <= 1e-5


def test_text_and_token_ids_agree(llm):
    ids = llm.tokenizer.encode(TEXTS[1])
    assert llm.embed([ids]) == llm.embed(TEXTS[1]) == llm.embed(ids)


def test_bad_prompts_are_request_errors(llm):
    vocab = llm.engine.model_config.vocab_size
    for bad in ([], [[]], [[vocab]], [[-1]], [[1, True]], [[1] * (llm.engine.max_model_len + 1)], "not a list"):
        with pytest.raises(RequestError):
            llm.engine.embed(bad)
    # A prompt of exactly max_model_len tokens is fine (no room for output is needed).
    assert len(llm.engine.embed([[5] * llm.engine.max_model_len])) == 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_matches_transformers_mean_pooled_last_hidden_state(checkpoint_dir, arch):
    transformers = pytest.importorskip("transformers")
    path = checkpoint_dir(arch)
    ref = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    # 70 tokens: past Mistral's 24-token sliding window, so its mask is exercised.
    prompts = random_prompts(3, 5, 70, ref.config.vocab_size, seed=5) + [random_prompts(1, 70, 70, 100, seed=6)[0]]
    with LLM(path, kv_cache_memory=16 << 20, max_num_batched_tokens=128, progress=False) as llm:
        got = torch.tensor(llm.embed(prompts))
    for i, p in enumerate(prompts):
        with torch.no_grad():
            h = ref(torch.tensor([p])).last_hidden_state[0]
        want = torch.nn.functional.normalize(h.mean(0), dim=0)
        assert (got[i] - want).abs().max().item() <= 1e-5, (arch, i)


def test_kv_cache_is_untouched(llm):
    eng = llm.engine
    free = eng.blocks.num_free_blocks
    kv_before = [k.clone() for k, _ in eng.runner.kv_caches]
    llm.embed(TEXTS)
    assert eng.blocks.num_free_blocks == free
    assert all(torch.equal(a, k) for a, (k, _) in zip(kv_before, eng.runner.kv_caches))


def test_alongside_generation_neither_output_changes(llm):
    prompts = [llm.tokenizer.encode(t) for t in ("Once upon a time", "The weather today")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone_gen = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone_emb = llm.embed(TEXTS)

    async def together():
        engine = AsyncEngine(llm.engine, name="emb-test")
        await engine.start()
        try:
            streams = [engine.add_request(f"g{i}", p, params) for i, p in enumerate(prompts)]

            async def collect(stream):
                toks = []
                async for out in stream:
                    toks += out.new_token_ids
                return toks

            gen_task = asyncio.gather(*(collect(s) for s in streams))
            # Several embedding calls while the two requests decode, interleaved with their steps.
            embs = []
            overlapped = 0
            for _ in range(3):
                embs.append(await engine.embed([llm.tokenizer.encode(t) for t in TEXTS]))
                overlapped += not gen_task.done()
            assert overlapped, "the generation finished before any embedding: nothing ran alongside"
            return await gen_task, embs
        finally:
            await engine.stop()

    gen, embs = asyncio.run(together())
    assert gen == alone_gen
    for e in embs:
        assert np.abs(np.array(e) - np.array(alone_emb)).max() <= 1e-5
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_async_embed_refusals(llm):
    from tokenyard.engines.serving.mock_engine import MockEngine

    async def run():
        real = AsyncEngine(llm.engine, name="emb-real")
        mock = AsyncEngine(MockEngine(DEMO), name="emb-mock")
        await real.start()
        await mock.start()
        try:
            with pytest.raises(RequestError, match="does not compute embeddings"):
                await mock.embed([[1, 2]])
            with pytest.raises(RequestError, match="prompt 1"):
                await real.embed([[1, 2], [10**9]])
            return await real.embed([[1, 2]])
        finally:
            await real.stop()
            await mock.stop()

    assert len(asyncio.run(run())[0]) == llm.engine.model_config.hidden_size
