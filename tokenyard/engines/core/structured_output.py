"""Structured outputs: a grammar matcher per constrained sequence, a token mask per sampled row.

A request asks for one of two response formats (the OpenAI shapes, already unwrapped):
    {"type": "json_object"}                          any JSON object
    {"type": "json_schema", "schema": {...}}          a JSON document valid against the schema

Rules:
- Grammars are compiled by xgrammar (chosen by measured mask cost: tokenyard/bench/grammar_mask_bench.py),
  imported lazily, so an engine without constrained requests never needs it.
- `Grammars.compile` runs in the caller's thread (add_request), so a schema the library rejects,
  or one over MAX_SCHEMA_CHARS, fails there as a GrammarError before anything is queued.
  Compiled grammars are cached by compact schema text (compiling is thread-safe).
- The engine thread owns each sequence's `Constraint`: the sampler fills the mask of the rows
  that carry one, and the engine advances it with every token it appends. Preemption keeps it
  (the output tokens survive preemption; only their K/V is recomputed).
- The output is compact JSON (no free whitespace): small models otherwise loop on newlines.
- What grammar a schema gets: tokenyard.engines.core.schema_keywords refuses the keywords the grammar would
  not enforce (checked here, before any compilation), tokenyard.engines.core.json_grammar bounds numbers and
  strings in xgrammar's conversion (a small model's loop ends; no raw control characters).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.core.json_grammar import json_schema_ebnf
from tokenyard.engines.core.schema_keywords import SchemaError, check_schema, rewrite_schema

if TYPE_CHECKING:   # the gateway imports this module (via SamplingParams); keep it free of torch
    import torch


class VocabBytes(Protocol):
    """What Grammars needs of a tokenizer (tokenyard.engines.text.tokenizer.Tokenizer is one)."""

    vocab_size: int

    def id_to_bytes(self, token_id: int) -> bytes: ...


MAX_SCHEMA_CHARS = 32_768   # canonical JSON text of one schema
CACHE_SIZE = 64             # compiled grammars kept (LRU)
_CPP_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")  # "[12:00:00] /project/cpp/x.cc:12: " on library errors


class GrammarError(RequestError):
    """A response format the engine cannot honour (bad shape, too big, or not compilable)."""


def check_response_format(fmt: Any) -> None:
    """Shape check only (no library): raises GrammarError naming the problem."""
    if not isinstance(fmt, dict):
        raise GrammarError(f"response_format must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "json_object":
        extra = set(fmt) - {"type"}
    elif kind == "json_schema":
        extra = set(fmt) - {"type", "schema", "name", "strict"}
        schema = fmt.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("response_format json_schema needs 'schema', a JSON Schema object")
        if len(schema_text(fmt)) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"response_format schema is {len(schema_text(fmt))} characters as compact JSON; "
                               f"the limit is {MAX_SCHEMA_CHARS}")
        try:
            check_schema(schema)
        except SchemaError as e:
            raise GrammarError(str(e)) from None
    else:
        raise GrammarError(f"response_format type must be 'json_object' or 'json_schema', got {kind!r}")
    if extra:
        raise GrammarError(f"response_format: unknown field(s) {', '.join(sorted(extra))}")


def schema_text(fmt: dict) -> str:
    """The cache key: compact JSON of the schema ("" for json_object). Keys keep their order: the
    order of "properties" is the order the fields are generated in."""
    if fmt.get("type") != "json_schema":
        return ""
    return json.dumps(fmt["schema"], separators=(",", ":"), ensure_ascii=False)


def _library() -> Any:
    try:
        import xgrammar
    except ImportError as e:  # a GPU box started from PYTHONPATH may not have it
        raise GrammarError("response_format needs the 'xgrammar' package on the engine host "
                           "(pip install xgrammar)") from e
    return xgrammar


class Constraint:
    """One sequence's grammar state: which tokens may come next, advanced token by token."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t%32 of word t//32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance over an emitted token; False if the grammar does not allow it (state unchanged)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The document is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


class Grammars:
    """Compiles response formats for one vocabulary; hands out a Constraint per request."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _library()
        self._xgr = xgr
        # RAW: each entry is the token's exact bytes; ids past the tokenizer's vocabulary (model
        # padding) are never allowed.
        info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tok: VocabBytes, vocab_size: int, stop_token_ids: list[int]) -> "Grammars":
        """The grammar set over a tokenizer's vocabulary (vocab_size: the model's, which may pad past the
        tokenizer's). Any object with vocab_size and id_to_bytes will do: the floor does not import text/."""
        return cls([tok.id_to_bytes(i) for i in range(min(tok.vocab_size, vocab_size))], vocab_size, stop_token_ids)

    def compile(self, fmt: dict) -> Any:
        check_response_format(fmt)
        key = fmt["type"] + ":" + schema_text(fmt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            if fmt["type"] == "json_object":
                ebnf = json_schema_ebnf(self._xgr, '{"type": "object"}', strict_mode=False)
            else:
                # strict_mode: properties the schema does not name are not generated (OpenAI's strict).
                text = json.dumps(rewrite_schema(fmt["schema"]), separators=(",", ":"), ensure_ascii=False)
                ebnf = json_schema_ebnf(self._xgr, text, strict_mode=True)
            compiled = self._compiler.compile_grammar(ebnf)
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError/ValueError with a message
            raise GrammarError(f"response_format schema cannot be compiled: {_clean(e)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, fmt: dict) -> Constraint:
        return Constraint(self._xgr.GrammarMatcher(self.compile(fmt)))


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)[:300]

