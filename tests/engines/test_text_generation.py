"""Text in, text out through LLM: tokenizer + engine + detokeniser against transformers."""
import io
from argparse import Namespace

import pytest
import torch
from tokenizer_factory import build_byte_level_dir

from tokenyard.engines import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world, this is Tokenyard.", "def add(a, b):\n    return a + b", "Ünïcödé 😀 café 123456",
         "   spaces   and\ttabs"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from tokenyard.bench.random_checkpoint import build_random_checkpoint

    d = tmp_path_factory.mktemp("textmodel")
    build_random_checkpoint(d, "llama", vocab_size=706, seed=4, bos_token_id=700, eos_token_id=705)
    build_byte_level_dir(d)  # tokenizer files next to the weights (vocab 700 + 6 specials)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(d)
    return d, LLM(d, kv_cache_memory=8 << 20), ref, hf_tok


def test_text_prompts_match_transformers_greedy(text_model):
    _, llm, ref, hf_tok = text_model
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ids = hf_tok(text)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == theirs
        assert out.outputs[0].text == hf_tok.decode(theirs, skip_special_tokens=True)
        assert out.prompt == text


def test_stop_string_cut_exactly(text_model):
    _, llm, _, hf_tok = text_model
    free = llm.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = free.text
    assert len(text) > 12
    stop = text[6:10]  # a stop string somewhere inside the greedy continuation
    cut = text[:text.find(stop)]
    out = llm.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == cut and out.finish_reason == "stop"
    assert stop not in out.text
    assert not llm.engine.has_unfinished()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_chat_applies_template(text_model):
    _, llm, ref, hf_tok = text_model
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    out = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    expected = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 8


def test_generate_cli_streams_text(text_model, capsys):
    from tokenyard.engines.serving import generate_cli

    d, llm, _, _ = text_model
    buf = io.StringIO()
    args = Namespace(model=str(d), prompt=TEXTS[0], chat=False, system=None, max_tokens=12, temperature=0.0,
                     top_p=1.0, top_k=0, seed=None, stop=[], quantization="none")
    assert generate_cli.run(args, out=buf) == 0
    expected = llm.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert buf.getvalue() == expected.outputs[0].text + "\n"
    assert "completion tokens" in capsys.readouterr().err


def test_token_ids_without_tokenizer_still_work(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), kv_cache_memory=4 << 20)
    assert llm.tokenizer is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
