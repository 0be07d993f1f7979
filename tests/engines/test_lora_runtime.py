"""LoRA adapters loaded and unloaded while the engine serves (Engine.load_adapter / unload_adapter).

The tiny random Llama and PEFT adapters of tests/engines/test_lora.py: an adapter loaded at run time
must give the tokens it gives when loaded at start-up, one that does not fit the base or the pool is
refused naming the tensor, an unload is refused while a request runs with the adapter and works once it
finished, and an unloaded name is refused like any unknown one.
"""
from __future__ import annotations

import pytest

from tests.engine_helpers import random_prompts
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.core.sampling_params import ParamError
from tokenyard.engines.lora.adapter_config import AdapterError
from tokenyard.engines.lora.adapter_errors import AdapterConflict, AdapterNotFound, AdapterUnsupported

pytest.importorskip("peft")
from tests.engines.test_lora import make_adapter  # noqa: E402 - after the importorskip


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, tmp_path_factory):
    base = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("runtime_adapters")
    return base, {
        "a": make_adapter(base, root / "a", seed=1),                              # rank 8, every module
        "rs": make_adapter(base, root / "rs", rank=4, alpha=4.0, seed=3, rslora=True),
        "wide": make_adapter(base, root / "wide", rank=16, seed=4),                # over the pool's rank 8
        "foreign": make_adapter(checkpoint_dir("llama_mha"), root / "foreign", targets=["k_proj"], seed=5),
    }


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(llm: LLM, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False, lora=names)]


def test_a_run_time_adapter_gives_its_start_up_tokens(adapters):
    base, paths = adapters
    prompts = random_prompts(4, 5, 20, 512, seed=21)
    names = ["rs", "a", None, "rs"]
    both = LLM(base, lora_modules={"a": str(paths["a"]), "rs": str(paths["rs"])}, kv_cache_memory=8 << 20)
    want = tokens(both, prompts, names)
    llm = LLM(base, lora_modules={"a": str(paths["a"])}, kv_cache_memory=8 << 20)
    with pytest.raises(ParamError, match="unknown LoRA adapter 'rs'"):
        tokens(llm, prompts[:1], ["rs"])
    info = llm.engine.load_adapter("rs", str(paths["rs"]))
    assert info["rank"] == 4 and info["name"] == "rs" and info["seconds"] > 0
    assert tokens(llm, prompts, names) == want
    stats = llm.engine.stats()
    assert stats.lora_names == ["a", "rs"] and set(stats.lora_resident) == {"a", "rs"}


def test_adapters_that_do_not_fit_are_refused_naming_the_tensor(adapters):
    base, paths = adapters
    llm = LLM(base, lora_modules={"a": str(paths["a"])}, kv_cache_memory=8 << 20)
    with pytest.raises(AdapterError, match=r"tensor .*layers\.0\.self_attn\.k_proj\.lora_B\.weight has shape "
                                           r"\[64, 8\], expected \[32, 8\]"):
        llm.engine.load_adapter("x", str(paths["foreign"]))
    with pytest.raises(AdapterError, match=r"tensor base_model\.model\.model\.layers\.0\.\w+\.\w+_proj\.lora_A"
                                           r"\.weight has rank 16, over this engine's adapter pool rank 8"):
        llm.engine.load_adapter("x", str(paths["wide"]))
    with pytest.raises(AdapterConflict, match="already loaded"):
        llm.engine.load_adapter("a", str(paths["rs"]))
    with pytest.raises(AdapterError, match="adapter name must be"):
        llm.engine.load_adapter("a:b", str(paths["rs"]))
    assert llm.engine.stats().lora_names == ["a"]       # nothing half-registered


def test_unload_waits_for_requests_then_forgets_the_name(adapters):
    base, paths = adapters
    llm = LLM(base, lora_modules={"a": str(paths["a"]), "rs": str(paths["rs"])}, kv_cache_memory=8 << 20)
    engine = llm.engine
    prompt = random_prompts(1, 8, 8, 512, seed=3)[0]
    before = tokens(llm, [prompt], ["rs"])
    engine.add_request("busy", prompt, SamplingParams(max_tokens=4, temperature=0.0, lora="rs"))
    with pytest.raises(AdapterConflict, match="1 request"):
        engine.unload_adapter("rs")
    while engine.has_unfinished():
        engine.step()
    engine.unload_adapter("rs")
    assert engine.stats().lora_names == ["a"]
    with pytest.raises(ParamError, match="unknown LoRA adapter 'rs'"):
        tokens(llm, [prompt], ["rs"])
    with pytest.raises(AdapterNotFound):
        engine.unload_adapter("rs")
    old_id = 2
    engine.load_adapter("rs", str(paths["rs"]))         # back, with a new id (the prefix cache keys blocks by it)
    assert engine.lora.ids["rs"] > old_id
    assert tokens(llm, [prompt], ["rs"]) == before


def test_an_engine_without_adapters_cannot_load_one(adapters):
    base, paths = adapters
    llm = LLM(base, kv_cache_memory=8 << 20)
    with pytest.raises(AdapterUnsupported, match="lora_modules"):
        llm.engine.load_adapter("a", str(paths["a"]))
