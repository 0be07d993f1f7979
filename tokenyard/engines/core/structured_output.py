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
    """One sequence's grammar state: which tokens may come next, advanced token by token.

    Closing: once `close_after` tokens were accepted (max_tokens less the engine's
    grammar_close_reserve), the mask keeps only tokens that lead out of the document wherever the grammar
    allows one: inside a string, a token that ends it (`"`, `"}`, `"],`...); outside, one made of `]` and
    `}`; else one towards the next required key (a comma). Where the grammar allows none of these (a
    minLength not reached, a required key's name, a number's digits) the full grammar mask stands. So a
    small model looping inside a value still ends with a complete document within its reserve, instead of
    being cut by max_tokens. Whether a string is open is tracked from the accepted tokens' bytes.
    """

    __slots__ = ("_matcher", "_closing", "_close_after", "_accepted", "_in_string", "_escape", "closed_early",
                 "prefetched")

    def __init__(self, matcher: Any, closing: "ClosingTokens | None" = None, close_after: int | None = None) -> None:
        self._matcher = matcher
        self._closing = closing if close_after is not None else None
        self._close_after = close_after if close_after is not None else 0
        self._accepted = 0
        self._in_string = False
        self._escape = False
        self.closed_early = False          # a closing mask narrowed a choice at least once
        # The mask of the current state, being filled on the engine's mask thread while the forward
        # runs (tokenyard/engines/runtime/mask_prefetch.py); accept() drops it, as it is then stale.
        self.prefetched: Any = None

    @property
    def closing(self) -> bool:
        """The closing reserve has started: the next mask is narrowed (fill_bitmasks)."""
        return self._closing is not None and self._accepted >= self._close_after

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 words, bit t%32 of word t//32)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.closing:
            self._narrow(bitmask, row)

    def _narrow(self, bitmask: torch.Tensor, row: int) -> None:
        """The closing rule on a filled row: the first tier that keeps any allowed token replaces it."""
        allowed = bitmask[row]
        for tier in self._closing.tiers(self._in_string):  # type: ignore[union-attr]
            n = min(allowed.numel(), tier.numel())
            kept = allowed[:n] & tier[:n]
            if bool(kept.any()):
                allowed.zero_()
                allowed[:n] = kept
                self.closed_early = True
                return

    def accept(self, token_id: int) -> bool:
        """Advance over an emitted token; False if the grammar does not allow it (state unchanged)."""
        self.prefetched = None
        if not self._matcher.accept_token(token_id):
            return False
        self._accepted += 1
        if self._closing is not None:
            self._track(self._closing.token_bytes(token_id))
        return True

    def _track(self, data: bytes) -> None:
        for b in data:
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif b == 0x5C:        # backslash
                    self._escape = True
                elif b == 0x22:        # the closing quote
                    self._in_string = False
            elif b == 0x22:
                self._in_string = True

    @property
    def is_terminated(self) -> bool:
        """The document is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


def fill_bitmasks(constraints: list[Any], bitmask: torch.Tensor) -> None:
    """bitmask[j] = constraints[j]'s mask, for a whole step's rows: the same words as each row's
    Constraint.fill_bitmask, with the closing narrowing done once over all closing rows (a few tensor
    ops for the batch instead of a few per row: 32 closing rows cost 0.4 ms one by one). Any object
    with fill_bitmask(bitmask, row) may stand in for a Constraint (it fills its own row)."""
    import torch
    groups: dict[int, tuple[list[torch.Tensor], list[int], list[Constraint]]] = {}
    for j, c in enumerate(constraints):
        if not isinstance(c, Constraint):
            c.fill_bitmask(bitmask, j)
            continue
        c._matcher.fill_next_token_bitmask(bitmask, j)
        if c.closing:
            tiers = c._closing.tiers(c._in_string)  # type: ignore[union-attr]
            if tiers[0].numel() != bitmask.shape[1]:
                c._narrow(bitmask, j)   # a tier of another width (a padded vocabulary): the row's own rule
                continue
            group = groups.setdefault(id(tiers), (tiers, [], []))
            group[1].append(j)
            group[2].append(c)
    for tiers, rows, cons in groups.values():
        index = torch.tensor(rows, dtype=torch.long)
        allowed = bitmask.index_select(0, index)
        narrowed = allowed.clone()
        decided = torch.zeros(len(rows), dtype=torch.bool)
        for tier in tiers:                          # the first tier that keeps anything wins
            kept = allowed & tier
            take = kept.any(dim=1) & ~decided
            narrowed[take] = kept[take]
            decided |= take
        bitmask.index_copy_(0, index, narrowed)
        for c, hit in zip(cons, decided.tolist()):
            if hit:
                c.closed_early = True


class ClosingTokens:
    """The vocabulary's closing tokens as bitmask rows, built once per Grammars (see Constraint)."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        import torch
        self._bytes = token_bytes
        words = (vocab_size + 31) // 32

        def mask(pred: Any) -> torch.Tensor:
            bits = [0] * words
            for i, b in enumerate(token_bytes):
                if b and pred(b):
                    bits[i // 32] |= 1 << (i % 32)
            # int32 words, as xgrammar fills them (bit 31 set means a negative word)
            return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in bits], dtype=torch.int32)

        structural = set(b'"]},')
        self._in_string = [mask(lambda b: b[:1] == b'"' and set(b) <= structural)]
        self._outside = [mask(lambda b: set(b) <= set(b"]}")), mask(lambda b: set(b) <= set(b"]},"))]

    def tiers(self, in_string: bool) -> list[torch.Tensor]:
        return self._in_string if in_string else self._outside

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""


class Grammars:
    """Compiles response formats for one vocabulary; hands out a Constraint per request."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _library()
        self._xgr = xgr
        # RAW: each entry is the token's exact bytes; ids past the tokenizer's vocabulary (model
        # padding) are never allowed.
        info = xgr.TokenizerInfo(token_bytes, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._token_bytes = token_bytes
        self._vocab_size = vocab_size
        self._closing: ClosingTokens | None = None
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

    def constraint(self, fmt: dict, max_tokens: int | None = None, close_reserve: int = 0) -> Constraint:
        """A fresh matcher for one request. With max_tokens and close_reserve > 0 it closes the document
        in the last close_reserve tokens (Constraint)."""
        matcher = self._xgr.GrammarMatcher(self.compile(fmt))
        if max_tokens is None or close_reserve <= 0:
            return Constraint(matcher)
        with self._lock:
            if self._closing is None:
                self._closing = ClosingTokens(self._token_bytes, self._vocab_size)
        return Constraint(matcher, self._closing, max(0, max_tokens - close_reserve))


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)[:300]

