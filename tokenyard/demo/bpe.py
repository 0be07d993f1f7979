"""The demo models' tokenizer: a byte-level BPE trained on the task suite's text.

Trained with the `tokenizers` library, then written in the Llama-3 `tokenizer.model` layout
(tiktoken format: one "base64(bytes) rank" line per token) with the chat special tokens and a
jinja chat template in tokenizer_config.json, so it loads through the same code as any other
checkpoint (tokenyard.engines.text.tokenizer).
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenyard.engines.text.byte_level import LLAMA3_PATTERN

# Llama-3's split, but digits one at a time: addition and counting are far easier to learn for
# a tiny model when every digit is its own token.
DEMO_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
assert DEMO_PATTERN != LLAMA3_PATTERN
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
END = "<|end|>"           # ends every message; the model's stop token
SPECIALS = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", END]

# Short role markers: tiny models learn the format faster than from Llama-3's header blocks.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('the demo chat template supports system, user and assistant roles') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] | trim + '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_level_alphabet() -> dict[int, str]:
    """Byte-level BPE's table: each byte -> the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, pattern: str = DEMO_PATTERN) -> Tokenizer:
    """A byte-level BPE (`tokenizers` library) with `pattern` as the pre-tokenizer split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | Path) -> Path:
    """Train on `texts` and write tokenizer.model + tokenizer_config.json into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level_bpe(texts, vocab_size)
    to_byte = {ch: b for b, ch in byte_level_alphabet().items()}
    # Trainer ids follow merge order after the 256-byte alphabet: exactly tiktoken's ranks.
    ranked = sorted(tok.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(bytes(to_byte[ch] for ch in piece)).decode('ascii')} {rank}"
             for rank, (piece, _) in enumerate(ranked)]
    (out_dir / "tokenizer.model").write_text("\n".join(lines) + "\n", encoding="ascii")
    base = len(ranked)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(base + i): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                                 "single_word": False, "special": True}
                                 for i, s in enumerate(SPECIALS)},
        "bos_token": BOS,
        "eos_token": END,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
        "pat_str": DEMO_PATTERN,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return out_dir


def special_ids(vocab_without_specials: int) -> dict[str, int]:
    return {s: vocab_without_specials + i for i, s in enumerate(SPECIALS)}
