"""LoRA adapters in the engine (tokenyard/engines/lora) against transformers + peft with the adapter merged.

A random tiny Llama (tests/conftest.py) and random PEFT adapters of every target module: the
engine's logits with an adapter must match the merged model's (fp32, relative error <= 1e-4 per
position, as the base parity tests), a mixed batch must equal each request run alone, eviction and
reload must not change tokens, and the prefix cache must never share blocks across adapters.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.engine_helpers import prompt_logits, random_prompts
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.lora.adapter_config import AdapterError

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REL_TOL = 1e-4   # fp32 engine vs fp32 transformers, worst position's max |diff| / max |logit|


def make_adapter(base_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float = 16.0, seed: int = 0,
                 targets: list[str] | None = None, rslora: bool = False, std: float = 0.1) -> Path:
    """A PEFT LoRA adapter with random A and B (B non-zero, so it changes the outputs), saved as PEFT does."""
    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or TARGETS, lora_dropout=0.0,
                          use_rslora=rslora, init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out_dir)
    return out_dir


def merged_model(base_dir: Path, adapter_dir: Path):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


@pytest.fixture(scope="module")
def setup(checkpoint_dir, tmp_path_factory):
    base = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {
        "a": make_adapter(base, root / "a", seed=1),
        "b": make_adapter(base, root / "b", rank=16, alpha=8.0, seed=2, targets=["q_proj", "v_proj", "down_proj"]),
        "rs": make_adapter(base, root / "rs", rank=4, alpha=4.0, seed=3, rslora=True),
    }
    return base, adapters


@pytest.fixture(scope="module")
def llm(setup):
    base, adapters = setup
    return LLM(base, lora_modules={k: str(v) for k, v in adapters.items()}, kv_cache_memory=16 << 20,
               max_num_batched_tokens=256)


def adapter_logits(llm, tokens: list[int], name: str | None) -> torch.Tensor:
    pool = llm.engine.lora
    pool.begin_step([pool.id_of(name)] * len(tokens))
    try:
        return prompt_logits(llm.engine, tokens)
    finally:
        pool.end_step()


@pytest.mark.parametrize("name", ["a", "b", "rs"])
@pytest.mark.parametrize("length", [40, 100])   # torch: the batched form (<= 64 rows, adapter_pool.BATCHED_MAX_ROWS), segments
@pytest.mark.parametrize("form", ["native", "torch"])   # the C kernel (tokenyard/kernels/cpu_lora.c), the torch forms
def test_logits_match_the_merged_peft_model(setup, llm, name, length, form, monkeypatch):
    if form == "native" and llm.engine.lora.native is None:
        pytest.skip("the C LoRA kernel is unavailable here (no C compiler)")
    if form == "torch":
        monkeypatch.setattr(llm.engine.lora, "native", None)
    base, adapters = setup
    ref = merged_model(base, adapters[name])
    prompt = random_prompts(1, length, length, ref.config.vocab_size, seed=5)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0]
    got = adapter_logits(llm, prompt, name)
    err = (got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values
    assert err.max().item() <= REL_TOL, f"worst position {err.argmax().item()}: {err.max().item():.2e}"
    # the adapter matters: the base's logits are far from the merged model's
    plain = adapter_logits(llm, prompt, None)
    assert ((plain - expected).abs().max() / expected.abs().max()).item() > 100 * REL_TOL


def test_greedy_tokens_match_the_merged_peft_model(setup, llm):
    base, adapters = setup
    ref = merged_model(base, adapters["a"])
    prompt = random_prompts(1, 12, 12, ref.config.vocab_size, seed=7)[0]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = llm.generate([prompt], params, use_tqdm=False, lora="a")[0].outputs[0].token_ids
    assert got == want


def test_a_mixed_batch_equals_each_request_alone(setup, llm):
    prompts = random_prompts(6, 5, 30, 512, seed=9)
    names = [None, "a", "b", "a", None, "rs"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora=names)]
    alone = [llm.generate([p], params, use_tqdm=False, lora=[n])[0].outputs[0].token_ids
             for p, n in zip(prompts, names)]
    assert batched == alone
    # the adapters change what is generated (else this test would prove nothing)
    base_only = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(x != y for x, y in zip(batched, base_only)) >= 3


def test_eviction_and_reload_give_the_same_tokens(setup):
    base, adapters = setup
    modules = {k: str(v) for k, v in adapters.items()}
    prompts = random_prompts(6, 5, 20, 512, seed=13)
    names = ["a", "b", "rs", "b", "a", None]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    roomy = LLM(base, lora_modules=modules, max_loaded_adapters=3, kv_cache_memory=8 << 20)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False, lora=names)]
    tight = LLM(base, lora_modules=modules, max_loaded_adapters=1, kv_cache_memory=8 << 20)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False, lora=names)]
    assert got == want
    stats = tight.engine.stats()
    assert stats.lora_evictions > 0 and stats.lora_loaded == 1 and stats.lora_adapters == 3
    # one at a time, each adapter evicted and read back in between, still the same
    again = [tight.generate([p], params, use_tqdm=False, lora=[n])[0].outputs[0].token_ids
             for p, n in zip(prompts, names)]
    assert again == want


def test_the_prefix_cache_is_never_shared_across_adapters(setup, llm):
    prompt = random_prompts(1, 70, 70, 512, seed=17)[0]
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(name):
        return llm.generate([prompt], params, use_tqdm=False, lora=[name])[0].num_cached_tokens

    first = cached("a")
    assert first == 0
    assert cached("a") == 64              # the same adapter reuses its 4 full blocks
    assert cached("b") == 0               # another adapter does not
    assert cached(None) == 0              # nor the base
    assert cached(None) == 64
    assert cached("b") == 64


def test_unknown_adapter_names_are_refused(llm):
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False, lora="nope")


def test_speculation_carries_adapters(setup):
    """ngram speculation verifies drafts with the adapter applied: greedy tokens are unchanged."""
    base, adapters = setup
    modules = {"a": str(adapters["a"])}
    prompt = [7, 8, 9, 10, 11] * 6
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20)
    spec = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20, speculative_method="ngram")
    want = plain.generate([prompt], params, use_tqdm=False, lora="a")[0].outputs[0].token_ids
    got = spec.generate([prompt], params, use_tqdm=False, lora="a")[0].outputs[0].token_ids
    assert got == want
    assert spec.engine.stats().spec_num_proposed > 0


def test_adapters_on_an_int8_base(setup):
    """End to end on a quantised base: the adapter's share of the logits, (int8 base + adapter) - (int8
    base), equals the fp32 engine's to within 5% of its largest value (the base's int8 rounding moves
    the activations the adapter sees)."""
    base, adapters = setup
    modules = {"a": str(adapters["a"])}
    prompt = random_prompts(1, 30, 30, 512, seed=19)[0]
    fp = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20)
    q = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20, quantization="int8")
    delta_fp = adapter_logits(fp, prompt, "a") - adapter_logits(fp, prompt, None)
    delta_q = adapter_logits(q, prompt, "a") - adapter_logits(q, prompt, None)
    rel = ((delta_q - delta_fp).abs().max() / delta_fp.abs().max()).item()
    assert rel <= 0.05, rel


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_each_quantised_projection_gets_exactly_its_adapter_product(setup, mode):
    """Layer by layer on int8 / int4 projections (QuantLinear): apply() adds scale * B(Ax) to the
    quantised layer's own output, for the adapter rows only (fp32, 1e-5 relative)."""
    from tokenyard.engines.model.quantized_linear import QuantLinear

    base, adapters = setup
    q = LLM(base, lora_modules={"a": str(adapters["a"])}, kv_cache_memory=8 << 20, quantization=mode,
            quant_group_size=32)
    pool, layer = q.engine.lora, q.engine.model.layers[1]
    assert isinstance(layer.qkv_proj, QuantLinear) and isinstance(layer.down_proj, QuantLinear)
    cfg = q.engine.model_config
    g = torch.Generator().manual_seed(0)
    rows = [0, pool.id_of("a"), 0, pool.id_of("a"), pool.id_of("a")]
    slot = pool.loaded[pool.id_of("a")]
    scale = pool.slot_scale[slot]
    for group, proj, k, modules in [("qkv", layer.qkv_proj, cfg.hidden_size, ["q_proj", "k_proj", "v_proj"]),
                                    ("down", layer.down_proj, cfg.intermediate_size, ["down_proj"])]:
        x = torch.randn(len(rows), k, generator=g)
        plain = proj(x)
        pool.begin_step(rows)
        try:
            got = layer.lora.apply(group, x, proj(x))
        finally:
            pool.end_step()
        want = [(x @ pool.a_of(m, 1)[slot].T) @ pool.b_of(m, 1)[slot].T * scale for m in modules]
        delta = torch.cat(want, dim=1)
        mask = torch.tensor([r != 0 for r in rows])[:, None]
        expected = plain + delta * mask
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5
        assert (got[~mask[:, 0]] == plain[~mask[:, 0]]).all()


def _edit_config(adapter_dir: Path, tmp_path: Path, **changes) -> Path:
    import shutil
    out = tmp_path / "edited"
    shutil.copytree(adapter_dir, out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def test_an_adapter_for_another_base_is_refused_naming_the_tensor(checkpoint_dir, setup, tmp_path):
    base, _ = setup
    other = checkpoint_dir("llama_mha")             # 4 kv heads: k_proj/v_proj are 64 wide, not 32
    foreign = make_adapter(other, tmp_path / "foreign", targets=["k_proj"])
    with pytest.raises(AdapterError, match=r"tensor .*layers\.0\.self_attn\.k_proj\.lora_B\.weight has shape \[64, 8\], "
                                           r"expected \[32, 8\]"):
        LLM(base, lora_modules={"x": str(foreign)}, kv_cache_memory=8 << 20)


def test_bad_adapter_configs_are_refused_by_name(setup, tmp_path):
    base, adapters = setup
    for changes, message in [({"r": 128}, "r must be an integer rank in 1..64"),
                             ({"use_dora": True}, "use_dora is true"),
                             ({"target_modules": ["q_proj", "lm_head"]}, "target_modules names lm_head"),
                             ({"r": 4}, r"layers\.0\.mlp\.down_proj\.lora_A\.weight has shape \[8, 128\], expected \[4, 128\]")]:
        bad = _edit_config(adapters["a"], tmp_path / str(len(message)), **changes)
        with pytest.raises(AdapterError, match=message):
            LLM(base, lora_modules={"x": str(bad)}, kv_cache_memory=8 << 20)


def test_lora_options_are_checked():
    from tokenyard.engines.core.config import EngineConfig
    with pytest.raises(ValueError, match="without ':'"):
        EngineConfig.from_options({"lora_modules": {"a:b": "/x"}})
    with pytest.raises(ValueError, match="not supported with tensor or pipeline"):
        EngineConfig.from_options({"lora_modules": {"a": "/x"}, "tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="max_loaded_adapters"):
        EngineConfig.from_options({"max_loaded_adapters": 0})


def test_the_triton_kernel_gives_the_torch_paths_tokens(setup, llm):
    """The engine with the Triton products (compiled on CUDA; here the interpreter, tests/triton_mode.py)
    generates the torch path's greedy tokens for a mixed batch."""
    pytest.importorskip("triton", reason="triton is not installed")
    from tests.triton_mode import INTERPRETED
    if not INTERPRETED:
        pytest.skip("the engine under test runs on the CPU: its Triton path needs the interpreter")
    prompts = random_prompts(4, 5, 20, 512, seed=23)
    names = ["a", None, "b", "rs"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora=names)]
    pool = llm.engine.lora
    pool.triton = True
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora=names)]
    finally:
        pool.triton = False
    assert got == want


def test_no_wrong_adapter_tokens_in_a_random_mixed_batch_with_preemption(setup):
    """Random adapters per request, a KV cache small enough to preempt, fewer pool slots than adapters:
    every request's greedy tokens equal its own run alone on a roomy engine."""
    base, adapters = setup
    modules = {k: str(v) for k, v in adapters.items()}
    g = torch.Generator().manual_seed(29)
    prompts = random_prompts(14, 8, 30, 512, seed=29)
    choices = [None, "a", "b", "rs"]
    names = [choices[i] for i in torch.randint(0, 4, (len(prompts),), generator=g).tolist()]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    roomy = LLM(base, lora_modules=modules, max_loaded_adapters=3, kv_cache_memory=8 << 20)
    alone = [roomy.generate([p], params, use_tqdm=False, lora=[n])[0].outputs[0].token_ids
             for p, n in zip(prompts, names)]
    # 8 KiB a block here (2 layers, 2 KV heads of 16, fp32): 12 blocks hold 192 tokens of the ~450 wanted
    tight = LLM(base, lora_modules=modules, max_loaded_adapters=2, kv_cache_memory=12 * 8192,
                enable_prefix_caching=False)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False, lora=names)]
    stats = tight.engine.stats()
    assert stats.num_preemptions > 0 and stats.lora_evictions > 0
    wrong = [i for i, (x, y) in enumerate(zip(got, alone)) if x != y]
    assert not wrong, f"requests {wrong} ({[names[i] for i in wrong]}) differ from their runs alone"


def test_steps_with_an_adapter_leave_the_c_decode_step_for_the_eager_forward(setup):
    """The C decode step serves base-only decode steps; a decode step holding an adapter request runs the
    eager forward (counted in lora_eager_steps), and the tokens are those of an engine without the C step."""
    base, adapters = setup
    modules = {"a": str(adapters["a"])}
    prompts = random_prompts(3, 5, 15, 512, seed=31)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eager = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20, cpu_decode_step="off")
    try:
        native = LLM(base, lora_modules=modules, kv_cache_memory=8 << 20, cpu_decode_step="on")
    except (RuntimeError, ValueError) as e:   # no C compiler here
        pytest.skip(f"the C decode step is unavailable: {e}")
    for names in ([None, None, None], ["a", None, "a"]):
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False, lora=names)]
        got = [o.outputs[0].token_ids for o in native.generate(prompts, params, use_tqdm=False, lora=names)]
        assert got == want, names
    runner = native.engine.runner
    assert runner.num_native_steps > 0 and native.engine.stats().lora_eager_steps > 0
