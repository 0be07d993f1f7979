"""The compiled CPU decode step (tokenyard/engines/model/compiled_decoder.py, knob cpu_compile).

One compiled engine is shared by the module (compiling costs tens of seconds cold, a few warm:
the inductor cache lives in ~/.cache/tokenyard/inductor). Its greedy tokens must equal the eager
engine's across the batch-1 / batch-n graph boundary and across block-table widths, and its
logits must match the eager forward to fp32 rounding (atol 1e-4 on logits of magnitude ~10).
Fallbacks (no compiler, a failed compile) are tested without compiling.
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.engine_helpers import random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.sequence import Sequence
from tokenyard.engines.model import compiled_decoder, model_runner
from tokenyard.engines.model.attention import AttentionMetadata
from tokenyard.engines.model.compiled_decoder import cache_dir
from tokenyard.kernels import paged_attention_torch as torch_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# The C decode step (tests/engines/test_native_decode.py) would take every batch these engines schedule.
OPTIONS = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=128, max_num_seqs=8, block_size=8, progress=False,
               cpu_decode_step="off")


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    path = checkpoint_dir("llama")
    compiled = Engine(path, cpu_compile="on", **OPTIONS)
    compiled.runner.compiled.stance = "fail_on_recompile"   # every step here must hit the warm-up's graph
    return compiled, Engine(path, cpu_compile="off", **OPTIONS)


def _generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    got = run_to_completion(engine)
    return [got[f"r{i}"] for i in range(len(prompts))]


def test_compiled_greedy_tokens_equal_eager_across_batch_and_width(engines):
    compiled, eager = engines
    assert compiled.runner.compiled is not None and eager.runner.compiled is None
    vocab = compiled.model_config.vocab_size
    # Contexts from 2 to ~100 tokens with block_size 8: table widths 1 (padded to 2) to 13.
    prompts = random_prompts(7, 2, 60, vocab, seed=5)
    before = compiled.runner.num_compiled_steps
    for batch in ([prompts[0]], prompts[:2], prompts):      # batch-1 graph, then the batch-n graph
        assert _generate(compiled, batch) == _generate(eager, batch)
    assert compiled.runner.num_compiled_steps - before >= 3 * GREEDY.max_tokens - 3
    assert compiled.runner.compiled.compile_seconds > 0


def test_compiled_logits_match_eager_forward(engines):
    compiled, _ = engines
    runner = compiled.runner
    vocab = compiled.model_config.vocab_size
    bs = compiled.config.block_size
    for n in (1, 3):
        seqs = [Sequence(f"s{i}", p, GREEDY, 0, i, 0, frozenset())
                for i, p in enumerate(random_prompts(n, 9, 30, vocab, seed=n))]
        try:
            for s in seqs:   # prefill eagerly through the engine's own cache
                p = s.token_ids
                compiled.blocks.grow(s.block_table, len(p) + 1)
                slots = [s.block_table[t // bs] * bs + t % bs for t in range(len(p))]
                meta = AttentionMetadata.build(slots, [len(p)], [len(p)], [s.block_table], bs, None, compiled.device)
                compiled.model(torch.tensor(p), torch.arange(len(p)), meta, runner.kv_caches,
                               torch.tensor([len(p) - 1]))
            ids = [s.token_ids[-1] for s in seqs]
            pos = [s.num_tokens for s in seqs]      # decode input: the last token again, at the next position
            tables = [s.block_table for s in seqs]
            slots = [t[q // bs] * bs + q % bs for t, q in zip(tables, pos)]
            lens = [q + 1 for q in pos]
            got = runner.compiled.run(ids, pos, slots, lens, tables)
            meta = AttentionMetadata.build(slots, [1] * n, lens, tables, bs, None, compiled.device)
            want = compiled.model(torch.tensor(ids), torch.tensor(pos), meta, runner.kv_caches, torch.arange(n))
        finally:
            for s in seqs:
                compiled.blocks.free(s)
        assert got.shape == want.shape == (n, vocab)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_cache_dir_is_used_and_overridable(engines, monkeypatch, tmp_path):
    compiled, _ = engines
    assert compiled.runner.compiled.cache_dir == cache_dir()
    # The C++ build of the graph (a .so per kernel) lands there. Frozen graphs bypass inductor's FX
    # graph cache in this torch, so there may be no fxgraph/ folder at all on a fresh machine.
    assert any(cache_dir().rglob("*.so")), "inductor built nothing into the cache dir"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "tokenyard" / "inductor"
    # inductor's own /tmp default (which it writes into the environment) counts as unset
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled_decoder._inductor_default())
    assert cache_dir() == tmp_path / "tokenyard" / "inductor"


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_attention_matches_the_paged_reference(sliding_window, kv_heads):
    g = torch.Generator().manual_seed(kv_heads)
    heads, hd, bs, num_blocks = 4, 16, 4, 40
    lens = [1, 3, 4, 5, 17, 30]
    tables = [torch.randperm(num_blocks, generator=g)[:-(-n // bs)].tolist() for n in lens]
    kc = torch.randn(kv_heads, num_blocks * bs, hd, generator=g)
    vc = torch.randn(kv_heads, num_blocks * bs, hd, generator=g)
    q = torch.randn(len(lens), heads, hd, generator=g)
    plan = torch_path.TorchAttentionPlan.build([1] * len(lens), lens, tables, bs, sliding_window)
    want = torch_path.paged_attention(q, kc, vc, plan, 0.25)
    width = max(len(t) for t in tables) + 1   # one block of padding beyond the longest
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    got = torch_path.decode_attention(q, kc, vc, table, torch.tensor(lens), bs, 0.25, sliding_window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- fallbacks (no compiling) ---------------------------------------------------------------------

def test_no_compiler_auto_decodes_eagerly_with_a_warning_and_on_raises(checkpoint_dir, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "compiler_error", lambda: "no C++ compiler (test)")
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "auto")   # the suite's conftest sets off
    with caplog.at_level(logging.WARNING, logger="tokenyard.engines.model.model_runner"):
        engine = Engine(checkpoint_dir("llama"), cpu_compile="auto", **OPTIONS)
    assert engine.runner.compiled is None
    assert "no C++ compiler (test)" in caplog.text
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        Engine(checkpoint_dir("llama"), cpu_compile="on", **OPTIONS)


def test_failed_compile_falls_back_under_auto_and_raises_under_on(checkpoint_dir, monkeypatch, caplog):
    def boom(self):
        raise RuntimeError("inductor exploded (test)")

    monkeypatch.setattr(compiled_decoder.CompiledDecoder, "warm_up", boom)
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "auto")   # the suite's conftest sets off
    with caplog.at_level(logging.WARNING, logger="tokenyard.engines.model.model_runner"):
        engine = Engine(checkpoint_dir("llama"), cpu_compile="auto", **OPTIONS)
    assert engine.runner.compiled is None and "decoding eagerly" in caplog.text
    prompt = random_prompts(1, 5, 5, engine.model_config.vocab_size)[0]
    engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert len(run_to_completion(engine)["x"]) == 3
    with pytest.raises(RuntimeError, match="inductor exploded"):
        Engine(checkpoint_dir("llama"), cpu_compile="on", **OPTIONS)


def test_auto_leaves_small_models_and_test_runs_eager_and_the_environment_overrides(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(compiled_decoder.CompiledDecoder, "warm_up", lambda self: 0.0)
    path = checkpoint_dir("llama")
    auto = dict(OPTIONS, cpu_compile="auto")
    assert Engine(path, **OPTIONS).runner.compiled is None            # the default: off
    assert Engine(path, **auto).runner.compiled is None               # the suite's conftest: off
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "auto")
    assert Engine(path, **auto).runner.compiled is None               # auto: a test-sized model
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    assert Engine(path, **auto).runner.compiled is not None           # auto: big enough
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "on")
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 10**12)
    assert Engine(path, **auto).runner.compiled is not None
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "off")
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    assert Engine(path, **auto).runner.compiled is None
    assert Engine(path, cpu_compile="on", **OPTIONS).runner.compiled is not None   # the knob wins
    with pytest.raises(ValueError, match="cpu_compile"):
        Engine(path, cpu_compile="yes", **OPTIONS)


def test_a_failing_compiled_step_falls_back_to_eager_under_auto(checkpoint_dir, monkeypatch):
    monkeypatch.setattr(compiled_decoder.CompiledDecoder, "warm_up", lambda self: 0.0)
    monkeypatch.setattr(model_runner, "AUTO_COMPILE_MIN_PARAMS", 0)
    calls = []

    def broken(self, *args):
        calls.append(1)
        raise RuntimeError("compiled step broke (test)")

    monkeypatch.setattr(compiled_decoder.CompiledDecoder, "run", broken)
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "auto")   # the suite's conftest sets off
    path = checkpoint_dir("llama")
    prompt = random_prompts(1, 6, 6, 100, seed=3)[0]
    eager = Engine(path, cpu_compile="off", **OPTIONS)
    eager.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    engine = Engine(path, cpu_compile="auto", **OPTIONS)
    engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert run_to_completion(engine)["x"] == run_to_completion(eager)["x"]
    assert len(calls) == 1 and engine.runner.compiled is None and engine.dead is None
    # under "on" the failure is fatal; the start-up warm-up request (warm_up.py) meets it, so the
    # engine fails to build instead of reporting ready dead
    with pytest.raises(RuntimeError, match="warm-up request: RuntimeError: compiled step broke"):
        Engine(path, cpu_compile="on", **OPTIONS)


def test_compiled_cpu_decode_reads_and_writes_quantised_blocks(checkpoint_dir):
    """cpu_compile on with an int8 cache: the compiled step quantises on write and dequantises the
    gathered codes inside the graph; its greedy tokens equal the eager engine's."""
    prompts = random_prompts(3, 2, 30, 512, seed=8)
    opts = dict(kv_cache_dtype="int8", kv_cache_memory=4 << 20, max_num_batched_tokens=64, max_num_seqs=4,
                block_size=8, progress=False)
    compiled = Engine(checkpoint_dir("llama"), cpu_compile="on", **opts)
    compiled.runner.compiled.stance = "fail_on_recompile"   # every decode step must hit the warm-up's graph
    eager = Engine(checkpoint_dir("llama"), cpu_compile="off", **opts)
    outs = {}
    for name, eng in (("compiled", compiled), ("eager", eager)):
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        outs[name] = run_to_completion(eng)
    assert compiled.runner.num_compiled_steps >= 15
    assert outs["compiled"] == outs["eager"]
