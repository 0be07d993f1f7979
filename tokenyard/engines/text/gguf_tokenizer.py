"""The tokenizer a GGUF file describes in its metadata, rebuilt with the `tokenizers` library.

A GGUF has no tokenizer.json; llama.cpp's converter stores the vocabulary (`tokenizer.ggml.tokens`,
id = position), the BPE merges, a type per token, the bos/eos/unk/pad ids and the name of the
pre-tokenizer (`tokenizer.ggml.pre`). From those this module builds the byte-level BPE that the
original tokenizer.json held:

- model: BPE over the vocabulary and merges (GPT-2 byte alphabet; a token stored in plain text
  that is not in that alphabet is respelled byte by byte, except control and user-defined
  tokens, which are matched literally in text and keep their ids);
- pre-tokenizer: the split the merges were learned with, chosen by `tokenizer.ggml.pre` from
  `PRE_TOKENIZERS` (an unknown name is refused: a wrong split gives plausible, wrong ids);
- control tokens (type 3) are special added tokens, user-defined ones (type 4) plain added tokens,
  both matched whole in text, as llama.cpp does;
- BOS is prepended by encode(add_special_tokens=True) only when `tokenizer.ggml.add_bos_token`
  says so; the chat template is `tokenizer.chat_template`.

Only byte-level BPE vocabularies (`tokenizer.ggml.model` = "gpt2": Llama-3, Qwen2, SmolLM2, ...)
are built; SentencePiece ("llama") and others are refused by name, and the engine then serves
token-id prompts only, as for a checkpoint folder without tokenizer files.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenyard.engines.core.errors import CheckpointError
from tokenyard.engines.formats import gguf_reader as gr
from tokenyard.engines.formats import prepared_cache
from tokenyard.engines.text.byte_level import LLAMA3_PATTERN, byte_level_table

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4

# Qwen2's split: as Llama-3's, but digits one at a time.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2() -> Any:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split(pattern: str) -> Any:
    return lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _digits_then_gpt2() -> Any:
    # SmolLM's tokenizer.json: every digit alone, then the GPT-2 split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


PRE_TOKENIZERS = {
    "default": _gpt2, "gpt2": _gpt2, "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "llama3": _split(LLAMA3_PATTERN), "llama-v3": _split(LLAMA3_PATTERN), "llama-bpe": _split(LLAMA3_PATTERN),
    "smaug-bpe": _split(LLAMA3_PATTERN),
    "qwen2": _split(QWEN2_PATTERN), "deepseek-r1-qwen": _split(QWEN2_PATTERN),
}


def _need(reader: Any, key: str, path: Path) -> Any:
    value = gr.metadata(reader, key)
    if value is None:
        raise CheckpointError(f"{path}: GGUF file has no tokenizer ({key} is missing)")
    return value


def build_hf_tokenizer(reader: Any, path: Path) -> HFTokenizer:
    """The `tokenizers.Tokenizer` the metadata describes (see the module doc)."""
    kind = gr.metadata(reader, "tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.model is missing)")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = _need(reader, "tokenizer.ggml.tokens", path)
    merges: list[str] = _need(reader, "tokenizer.ggml.merges", path)
    types: list[int] = gr.metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    pre = gr.metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(PRE_TOKENIZERS)}")
    alphabet = byte_level_table()
    vocab: dict[str, int] = {}
    for i, (tok, kind_of) in enumerate(zip(tokens, types)):
        literal = kind_of in (CONTROL, USER_DEFINED) or all(ch in alphabet for ch in tok)
        spelled = tok if literal else "".join(_byte_char(b) for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    pairs = []
    for n, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges[{n}] is not two tokens: {merge!r}")
        pairs.append((parts[0], parts[1]))
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # the Rust side rejects merges naming tokens outside the vocabulary
        raise CheckpointError(f"{path}: the GGUF vocabulary and merges do not form a BPE model ({e})") from e
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    bos = gr.metadata(reader, "tokenizer.ggml.bos_token_id")
    if gr.metadata(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                           special_tokens=[(tokens[bos], int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


_CHAR_OF_BYTE: dict[int, str] = {}


def _byte_char(b: int) -> str:
    if not _CHAR_OF_BYTE:
        _CHAR_OF_BYTE.update({byte: ch for ch, byte in byte_level_table().items()})
    return _CHAR_OF_BYTE[b]


@dataclass(frozen=True, slots=True)
class TokenizerParts:
    """What Tokenizer.from_dir needs to wrap a GGUF file's tokenizer."""

    hf: Any                               # tokenizers.Tokenizer
    config: dict[str, Any]                # tokenizer_config.json-shaped special tokens
    generation_config: dict[str, Any]     # extra end-of-sequence ids
    template: str | None                  # tokenizer.chat_template


def tokenizer_parts(path: str | Path) -> TokenizerParts:
    """Vocabulary, specials and chat template of a GGUF file, from its metadata; kept in the
    prepared-weights cache (formats/prepared_cache.py) as the tokenizers library's own JSON, since
    parsing the metadata and building the BPE takes about 2 s on SmolLM2's 49k-token vocabulary
    (a gateway's start, a replica's grammar warm-up), and reading that JSON back a few ms."""
    path = Path(path)
    if prepared_cache.cache_dir() is None:
        return _tokenizer_parts(path)
    key = prepared_cache.make_key("gguf-tokenizer", {"source": prepared_cache.source_identity(path), "format": 1})
    hit = prepared_cache.load_json("gguf-tokenizer", key)
    if isinstance(hit, dict):
        try:
            return TokenizerParts(HFTokenizer.from_str(hit["tokenizer"]), dict(hit["config"]),
                                  dict(hit["generation_config"]), hit["template"])
        except Exception:  # noqa: BLE001 - a bad entry (from Rust: plain Exception) is rebuilt, never served
            log.warning("prepared-weights cache: the tokenizer entry of %s is unusable; rebuilding it", path.name)
    parts = _tokenizer_parts(path)
    prepared_cache.store_json("gguf-tokenizer", key, {"tokenizer": parts.hf.to_str(), "config": parts.config,
                                                      "generation_config": parts.generation_config,
                                                      "template": parts.template})
    return parts


def _tokenizer_parts(path: Path) -> TokenizerParts:
    reader = gr.open_gguf(path)
    hf = build_hf_tokenizer(reader, path)
    tokens = gr.metadata(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = gr.metadata(reader, f"tokenizer.ggml.{key}")
        if i is None:
            return None
        if not 0 <= int(i) < len(tokens):
            raise CheckpointError(f"{path}: tokenizer.ggml.{key} = {i} is outside the vocabulary of {len(tokens)}")
        return tokens[int(i)]

    config = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
              "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    extra_eos = [gr.metadata(reader, f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
    generation_config = {"eos_token_id": [int(i) for i in extra_eos if i is not None]}
    template = gr.metadata(reader, "tokenizer.chat_template")
    return TokenizerParts(hf, config, generation_config, template if isinstance(template, str) else None)
