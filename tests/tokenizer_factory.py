"""Build small tokenizer folders for tests, offline, in a few hundred milliseconds.

Every builder writes a folder that `tokenyard.engines.text.tokenizer.Tokenizer.from_dir` (and transformers'
`AutoTokenizer.from_pretrained`) can load, and returns its path:

- `build_byte_level_dir`: Llama-3 style tokenizer.json (byte-level BPE trained on `CORPUS`,
  Llama-3 split regex, specials appended after the base vocabulary, BOS added by the
  post-processor), tokenizer_config.json with a Llama-3 style chat template,
  generation_config.json with two EOS ids.
- `build_tiktoken_dir`: the same vocabulary as a tiktoken-format tokenizer.model ("base64 rank"
  lines) plus tokenizer_config.json's added_tokens_decoder; no tokenizer.json.
- `build_byte_fallback_dir`: Llama-2 / Mistral style tokenizer.json (metaspace "▁", <0xNN>
  byte-fallback tokens, decoder that strips one leading space); or with a Metaspace decoder.
- `build_sentencepiece_only_dir`: a binary (protobuf-looking) tokenizer.model and nothing else.

Use them from a session-scoped fixture so each folder is built once per test run:

    @pytest.fixture(scope="session")
    def llama3_dir(tmp_path_factory):
        return build_byte_level_dir(tmp_path_factory.mktemp("llama3"))
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tokenyard.demo.bpe import byte_level_alphabet, train_byte_level_bpe  # noqa: F401  (alphabet re-exported)

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama-3 layout: specials come after the base vocabulary, in this order.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

# A Llama-3 style chat template (written for these tests; same shape as Meta's).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Varied on purpose: the vocabulary stays small (so CJK and emoji split into several byte
# tokens) but covers code, digits, whitespace runs and several scripts.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12:45 and we've 3,141 apples!",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 100; ++i) { total += values[i] * 2; }  // sum",
    "Héllo wörld, ça va? Élève naïve façade coöperate — déjà vu.",
    "Привет, мир! Как дела? Всё хорошо, спасибо.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "こんにちは世界。東京は大きな都市です。",
    "안녕하세요 세계! 반갑습니다.",
    "emoji party 😀😃😄 🎉🎉 👍🏽 ❤️ 🚀 done",
    "Numbers: 0 1 22 333 4444 55555 3.14159 2.71828 1e-9 0xFF 1_000_000",
    "    indented\t\ttabs   and   runs     of spaces\n\n\nnew lines\r\nwindows",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY 2 DESC;",
    "I'm sure they'll say we'd rather you're not there, isn't it? You've done well.",
    "العربية لغة جميلة. مرحبا بالعالم",
    "Ελληνικά: Καλημέρα κόσμε. עברית: שלום עולם",
    "<html><body><p class=\"x\">Hello &amp; welcome</p></body></html>",
    "Math: ∑ x² = ∫ f(x) dx ≈ π ≠ ∞; α β γ δ → ⇒ ∀ ∃",
]


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2), encoding="utf-8")


def _train_byte_level(vocab_size: int) -> Tokenizer:
    return train_byte_level_bpe(CORPUS * 3, vocab_size, LLAMA3_PATTERN)


def _added_tokens_decoder(first_id: int, names: list[str]) -> dict[str, dict]:
    return {str(first_id + i): {"content": name, "lstrip": False, "rstrip": False, "normalized": False,
                                "single_word": False, "special": True} for i, name in enumerate(names)}


def build_byte_level_dir(path: Path, vocab_size: int = 700, chat_template: str | None = LLAMA3_TEMPLATE,
                         template_file: bool = False) -> Path:
    """Llama-3 style folder; the template goes into chat_template.jinja when template_file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_byte_level(vocab_size)
    base = tok.get_vocab_size()
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = LLAMA3_SPECIALS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(base, LLAMA3_SPECIALS),
        "bos_token": bos,
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
    }
    if chat_template is not None and template_file:
        (path / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    elif chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(path / "tokenizer_config.json", config)
    _write_json(path / "generation_config.json",
                {"bos_token_id": base, "eos_token_id": [base + 1, base + 5]})
    return path


def build_tiktoken_dir(path: Path, vocab_size: int = 700, add_bos_token: bool = True) -> Path:
    """tiktoken-format tokenizer.model with the byte-level BPE's tokens as ranks (merge order)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_byte_level(vocab_size)
    to_byte = {ch: b for b, ch in byte_level_alphabet().items()}
    # The trainer's ids follow merge order after the alphabet, which is what tiktoken ranks mean.
    ranked = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
    lines = []
    for rank, (piece, _) in enumerate(ranked):
        raw = bytes(to_byte[ch] for ch in piece)
        lines.append(f"{base64.b64encode(raw).decode('ascii')} {rank}")
    (path / "tokenizer.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(len(ranked), LLAMA3_SPECIALS),
        "bos_token": LLAMA3_SPECIALS[0],
        # the AddedToken form, as HF also writes it
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "add_bos_token": add_bos_token,
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA3_TEMPLATE,
    })
    return path


def build_byte_fallback_dir(path: Path, vocab_size: int = 600, metaspace_decoder: bool = False) -> Path:
    """Llama-2 / Mistral style: '▁' metaspace, <0xNN> byte tokens, BOS '<s>', leading-space strip.

    metaspace_decoder: decode with tokenizers' Metaspace decoder instead (older T5-style files),
    which leaves <0xNN> pieces as literal text.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = meta
    # limit_alphabet drops rare characters (most CJK, emoji) so that they go through byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False, limit_alphabet=90)
    trainer_tok.train_from_iterator(CORPUS * 3, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {name: i for i, name in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in trained["merges"]], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    if metaspace_decoder:
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(i): {"content": s, "special": True, "normalized": False, "lstrip": False,
                                          "rstrip": False, "single_word": False} for i, s in enumerate(specials)},
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "clean_up_tokenization_spaces": False,
    })
    return path


def build_sentencepiece_only_dir(path: Path) -> Path:
    """A binary tokenizer.model (bytes shaped like a SentencePiece protobuf) and no tokenizer.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    piece = b"\x0a\x05<unk>\x15\x00\x00\x00\x00\x18\x02"
    (path / "tokenizer.model").write_bytes(b"\x0a" + bytes([len(piece)]) + piece + b"\x22\x0b\x0a\x03bpe\x10\x80\xfa\x01")
    _write_json(path / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})
    return path
