"""The committed demo LoRA adapters (tokenyard/models/demo-large-lora/*, `tokenyard demo train-lora`).

Each one must load into an engine serving demo-large, change its outputs, and give the logits of
the base with the adapter merged by PEFT (W + scale * B A, fp32) within the engine's LoRA parity
bound (max |diff| / max |logit| <= 1e-4 per position, as tests/engines/test_lora.py). Their gain on
their task is a benchmark (bench/results/demo_lora_eval.json), not a test.
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.engine_helpers import prompt_logits
from tokenyard.demo.train_lora import ADAPTERS, MODELS
from tokenyard.engines import LLM

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REL_TOL = 1e-4
BASE = MODELS / "demo-large"
NAMES = sorted(p.name for p in ADAPTERS.iterdir() if (p / "adapter_config.json").is_file()) if ADAPTERS.is_dir() else []
MAX_BYTES = 2 << 20   # the demo adapters stay small (rank 8, bf16: about 0.6 MB)


def test_there_are_demo_adapters():
    assert len(NAMES) >= 2, f"expected the committed demo adapters under {ADAPTERS}"


@pytest.fixture(scope="module")
def llm():
    return LLM(BASE, lora_modules={n: str(ADAPTERS / n) for n in NAMES}, kv_cache_memory=32 << 20,
               max_loaded_adapters=max(1, len(NAMES)), progress=False)


def _logits(llm, tokens: list[int], name: str | None) -> torch.Tensor:
    pool = llm.engine.lora
    pool.begin_step([pool.id_of(name)] * len(tokens))
    try:
        return prompt_logits(llm.engine, tokens)
    finally:
        pool.end_step()


@pytest.mark.parametrize("name", NAMES)
def test_adapter_is_small_and_in_peft_format(name):
    cfg = json.loads((ADAPTERS / name / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and 8 <= cfg["r"] <= 16
    assert (ADAPTERS / name / "adapter_model.safetensors").stat().st_size <= MAX_BYTES


@pytest.mark.parametrize("name", NAMES)
def test_adapter_changes_outputs_and_equals_the_merged_weights(llm, name):
    base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, ADAPTERS / name).merge_and_unload().eval()
    messages = [{"role": "user", "content": "Reverse the words: apple river stone"}]
    from tokenyard.engines.text.chat_template import apply_chat_template
    tok = llm.tokenizer
    prompt = tok.encode(apply_chat_template(tok, messages), add_special_tokens=False)
    with torch.no_grad():
        expected = merged(torch.tensor([prompt])).logits[0]
    got = _logits(llm, prompt, name)
    err = (got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values
    assert err.max().item() <= REL_TOL, f"worst position {err.argmax().item()}: {err.max().item():.2e}"
    plain = _logits(llm, prompt, None)
    assert ((plain - expected).abs().max() / expected.abs().max()).item() > 100 * REL_TOL
