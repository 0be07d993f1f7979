"""The serving model's tokenizer, loaded from its checkpoint folder without model weights.

Two file formats are read, in this order of preference:

1. `tokenizer.json` (the Hugging Face "fast" tokenizer), through the `tokenizers` library, so
   every BPE merge order, normaliser and post-processor is applied exactly as HF does;
2. a tiktoken-format `tokenizer.model` (Llama-3 original release: one "base64-token rank" line
   per token), through `tiktoken.Encoding`, with the Llama-3 split regex unless
   tokenizer_config.json gives `pat_str`; special tokens and their ids come from
   tokenizer_config.json's `added_tokens_decoder`.

A SentencePiece protobuf `tokenizer.model` alone is refused: running SentencePiece would need
another dependency and another set of encoding rules to keep exact; every SentencePiece model
on the Hub ships (or converts once into) a tokenizer.json.

HF's `clean_up_tokenization_spaces` is deliberately not applied by `decode`: it is lossy
(" ." -> ".") and streamed text could never match it, since it depends on what comes next.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from pathlib import Path
from typing import Any, Iterable

import tiktoken
from tokenizers import Tokenizer as HFTokenizer

from tokenyard.engines.core.errors import CheckpointError, RequestError
from tokenyard.engines.text import gguf_tokenizer
from tokenyard.engines.text.byte_level import LLAMA3_PATTERN, byte_level_table

TIKTOKEN_FILES = ("tokenizer.model", "tiktoken.model")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]*={0,2} [0-9]+\r?$")
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_tokens(config: dict[str, Any]) -> dict[int, tuple[str, bool]]:
    """tokenizer_config.json added_tokens_decoder -> {id: (content, special)}."""
    out: dict[int, tuple[str, bool]] = {}
    for key, value in (config.get("added_tokens_decoder") or {}).items():
        content = _token_text(value)
        if content is None or not str(key).isdigit():
            raise CheckpointError(f"tokenizer_config.json: bad added_tokens_decoder entry {key!r}: {value!r}")
        special = bool(value.get("special", True)) if isinstance(value, dict) else True
        out[int(key)] = (content, special)
    return out


def _is_tiktoken_file(path: Path) -> bool:
    """tiktoken files are ASCII "base64 rank" lines; SentencePiece files are binary protobuf."""
    with path.open("rb") as f:
        head = f.read(4096)
    first = head.split(b"\n", 1)[0]
    return bool(first) and _TIKTOKEN_LINE.match(first) is not None


class _HFBackend:
    """tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: Path, tok: HFTokenizer | None = None) -> None:
        """From tokenizer.json at path, or from `tok` built elsewhere (a GGUF file's metadata)."""
        try:
            self.tok = tok if tok is not None else HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exception subclasses from Rust
            raise CheckpointError(f"{path}: cannot be loaded by the tokenizers library ({e})") from e
        added = self.tok.get_added_tokens_decoder()
        self.added_bytes = {i: t.content.encode("utf-8") for i, t in added.items()}
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.vocab_size = max([self.tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])
        self._cache: dict[int, bytes] = {}
        self._configure_pieces()

    def _configure_pieces(self) -> None:
        """Learn from the decoder how a vocabulary piece turns into bytes (see `token_bytes`)."""
        self.mode = "plain"
        self.byte_fallback = False
        self.strips_leading_space = False
        self.space_char = "▁"
        if self.tok.decoder is None:
            return
        state = json.loads(self.tok.decoder.__getstate__())
        steps = state.get("decoders", [state]) if state.get("type") == "Sequence" else [state]
        for step in steps:
            kind = step.get("type")
            if kind == "ByteLevel":
                self.mode = "byte_level"
                self.byte_of = byte_level_table()
            elif kind == "ByteFallback":
                self.byte_fallback = True
            elif kind == "Replace" and step.get("content") == " ":
                self.mode, self.space_char = "metaspace", step.get("pattern", {}).get("String", "▁")
            elif kind == "Metaspace":
                self.mode, self.space_char = "metaspace", step.get("replacement", "▁")
                scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
                self.strips_leading_space = scheme != "never"
            elif kind == "Strip" and step.get("content") == " " and step.get("start", 0) >= 1:
                self.strips_leading_space = True

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        if token_id in self.added_bytes:
            raw = self.added_bytes[token_id]
        else:
            piece = self.tok.id_to_token(token_id)
            if piece is None:  # padded embedding rows beyond the vocabulary have no text
                raw = b""
            elif self.mode == "byte_level":
                try:
                    raw = bytes(self.byte_of[ch] for ch in piece)
                except KeyError:  # not a byte-level piece after all: take its text
                    raw = piece.encode("utf-8")
            elif self.mode == "metaspace":
                m = _BYTE_PIECE.match(piece) if self.byte_fallback else None
                raw = bytes([int(m.group(1), 16)]) if m else piece.replace(self.space_char, " ").encode("utf-8")
            else:  # WordPiece and other decoders: the library's own text for the lone token
                raw = self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        self._cache[token_id] = raw
        return raw

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, post_process: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=post_process).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _TiktokenBackend:
    """A tiktoken-format tokenizer.model through `tiktoken.Encoding`."""

    strips_leading_space = False

    def __init__(self, path: Path, config: dict[str, Any]) -> None:
        ranks: dict[bytes, int] = {}
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except (ValueError, binascii.Error) as e:
                    raise CheckpointError(f"{path}:{lineno}: not a 'base64-token rank' line") from e
        added = _added_tokens(config)
        by_id: dict[int, bytes] = {rank: token for token, rank in ranks.items()}
        if len(by_id) != len(ranks):
            raise CheckpointError(f"{path}: two tokens share a rank")
        clash = sorted(i for i in added if i in by_id)
        if clash:
            raise CheckpointError(f"{path}: added_tokens_decoder ids {clash[:5]} are also ranks in the BPE file")
        pattern = config.get("pat_str") or LLAMA3_PATTERN
        try:
            # Every added token (special or not) is matched literally in text, as HF does by default.
            self.enc = tiktoken.Encoding(name=f"tokenyard-{path.parent.name}", pat_str=pattern,
                                         mergeable_ranks=ranks, special_tokens={c: i for i, (c, _) in added.items()})
        except Exception as e:  # tiktoken raises ValueError or a Rust error for a bad regex or ranks
            raise CheckpointError(f"{path}: tiktoken cannot build an encoding ({e})") from e
        for i, (content, _) in added.items():
            by_id[i] = content.encode("utf-8")
        self.vocab_size = max(by_id) + 1 if by_id else 0
        self._bytes = [by_id.get(i, b"") for i in range(self.vocab_size)]  # gaps decode to nothing
        self._ids = {content: i for i, (content, _) in added.items()}
        self._ranks = ranks
        self.special_ids = frozenset(i for i, (_, special) in added.items() if special)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def token_to_id(self, token: str) -> int | None:
        if token in self._ids:
            return self._ids[token]
        return self._ranks.get(token.encode("utf-8"))

    def encode(self, text: str, post_process: bool) -> list[int]:
        return self.enc.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        # Special ids were already dropped by Tokenizer.decode when skipping.
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")


class Tokenizer:
    """Encode, decode and count tokens for one model; build it with `Tokenizer.from_dir`."""

    def __init__(self, backend: _HFBackend | _TiktokenBackend, config: dict[str, Any],
                 generation_config: dict[str, Any], chat_template: str | None, source: Path) -> None:
        self._backend = backend
        self.source = source
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        if self.bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_token_id = generation_config["bos_token_id"]
        eos = [self._id_of(self.eos_token)]
        gen_eos = generation_config.get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        # The tokenizer's own EOS first, then generation_config's extras (Llama-3 <|eot_id|>, ...).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if isinstance(i, int)))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        named = [self._id_of(_token_text(config.get(k))) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
        self._special = backend.special_ids | {i for i in named if i is not None}
        # tokenizer.json's post-processor decides what encode() adds (transformers 5 keeps it even
        # when tokenizer_config.json says add_bos_token). tiktoken files have no post-processor:
        # there add_bos_token / add_eos_token decide, and absent means "add nothing".
        self._manual_specials = isinstance(backend, _TiktokenBackend)
        self._add_bos = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        eos_id = self._id_of(self.eos_token)
        self._add_eos = bool(config.get("add_eos_token", False)) and eos_id is not None
        self._eos_for_encode = eos_id

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        if model_dir.suffix.lower() == ".gguf" and not model_dir.is_dir():
            # a single-file checkpoint: its metadata holds the vocabulary, specials and template
            p = gguf_tokenizer.tokenizer_parts(model_dir)
            return cls(_HFBackend(model_dir, tok=p.hf), p.config, p.generation_config, p.template, model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: not a folder")
        config = _read_json(model_dir / "tokenizer_config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        backend: _HFBackend | _TiktokenBackend
        if (model_dir / "tokenizer.json").is_file():
            backend = _HFBackend(model_dir / "tokenizer.json")
        else:
            model_file = next((model_dir / n for n in TIKTOKEN_FILES if (model_dir / n).is_file()), None)
            if model_file is None:
                raise CheckpointError(f"{model_dir}: no tokenizer.json (nor a tiktoken-format tokenizer.model)")
            if not _is_tiktoken_file(model_file):
                raise CheckpointError(
                    f"{model_dir}: {model_file.name} is a SentencePiece model and tokenizer.json is missing; "
                    "create tokenizer.json once with transformers: "
                    "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
            backend = _TiktokenBackend(model_file, config)
        return cls(backend, config, generation_config, _chat_template(model_dir, config), model_dir)

    # -- encoding -----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; special-token strings in it become their ids (HF's default).

        add_special_tokens adds what the tokenizer's configuration adds (usually BOS). Chat
        prompts rendered from a template already hold BOS: encode those with False.
        """
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be a string, got {type(text).__name__}")
        if not add_special_tokens or not self._manual_specials:
            return self._backend.encode(text, post_process=add_special_tokens)
        ids = self._backend.encode(text, post_process=False)
        if self._add_bos:
            ids.insert(0, self.bos_token_id)
        if self._add_eos:
            ids.append(self._eos_for_encode)
        return ids

    def count_tokens(self, text: str, add_special_tokens: bool = False) -> int:
        """How many tokens text costs (without BOS by default: templates put it in the text)."""
        return len(self.encode(text, add_special_tokens=add_special_tokens))

    # -- decoding -----------------------------------------------------------------------------

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            # tokenizers only skips its own special added tokens; drop BOS/EOS named in the config too.
            ids = [i for i in ids if i not in self._special]
        return self._backend.decode(ids, skip_special_tokens)

    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes token_id stands for, for incremental decoding (b"" for unknown ids).

        Concatenating these equals decode()'s UTF-8 (before replacement of broken characters)
        except that a leading space is dropped when `strips_leading_space` (SentencePiece).
        """
        return self._backend.token_bytes(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    # -- properties ---------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """One past the highest token id (base vocabulary plus added tokens)."""
        return self._backend.vocab_size

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._special)

    @property
    def strips_leading_space(self) -> bool:
        """Whether decode() drops one leading space of the whole text (SentencePiece's "▁" prefix)."""
        return self._backend.strips_leading_space

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def __repr__(self) -> str:
        kind = ("gguf" if self.source.suffix.lower() == ".gguf" else "tokenizer.json") \
            if isinstance(self._backend, _HFBackend) else "tiktoken"
        return f"Tokenizer({str(self.source)!r}, {kind}, vocab_size={self.vocab_size})"


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (newer HF saves) wins over tokenizer_config.json's chat_template."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None
