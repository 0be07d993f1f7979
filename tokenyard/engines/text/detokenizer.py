"""Stream generated tokens out as text deltas, applying stop strings on the way.

Two things force text to be held back between steps:

- a character split across tokens: byte-level BPE (and <0xNN> byte fallback) often spends
  several tokens on one emoji or CJK character, so tokens are turned into bytes and only
  complete UTF-8 characters are released (Python's incremental UTF-8 decoder keeps the
  incomplete tail; it is decoded with replacement only at `finish`);
- a possible stop string: a text suffix that could be the start of a stop string waits until
  the next characters decide. A stop string may span several tokens; the text is cut exactly
  before it (after it with include_stop_str_in_output), and no part of it is ever released.

When several stop strings occur, the one that is complete first in the text wins (ties: the
longer one), so the result does not depend on how tokens were grouped into `add` calls.

Each `add` costs O(new text + longest stop string): only the held-back tail, which is shorter
than the longest stop string, is searched again.
"""
from __future__ import annotations

import codecs
from typing import Iterable, Protocol, Sequence

from tokenyard.engines.core.errors import RequestError


class TokenBytes(Protocol):
    """What the detokenizer needs from a tokenizer (tokenyard.engines.text.tokenizer.Tokenizer has it)."""

    strips_leading_space: bool

    def id_to_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


class IncrementalDetokenizer:
    """One request's output text. Concatenated deltas from `add` and `finish` equal `text`.

    prompt_token_ids: only whether there is a prompt matters. Without one, the first output
    token's leading space is dropped on tokenizers whose decode() does so (SentencePiece "▁"),
    so the text equals tokenizer.decode(output ids); after a prompt the space is real text.
    """

    def __init__(self, tokenizer: TokenBytes, prompt_token_ids: Sequence[int] | None = None,
                 stop: Iterable[str] | None = None, skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False) -> None:
        stops = list(stop or [])
        bad = [s for s in stops if not isinstance(s, str)]
        if bad:
            raise RequestError(f"stop strings must be strings, got {bad[0]!r}")
        self._tokenizer = tokenizer
        self._stops = [s for s in dict.fromkeys(stops) if s]  # an empty stop string would stop at once
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop_str_in_output
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        has_prompt = prompt_token_ids is not None and len(prompt_token_ids) > 0
        self._strip_space = tokenizer.strips_leading_space and not has_prompt
        self._held = ""  # decoded, not released: may be the start of a stop string
        self._parts: list[str] = []  # released deltas; joined lazily so `add` stays O(new text)
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, new_token_ids: Iterable[int] | int) -> str:
        """Take newly generated tokens; return the text that can be released now (maybe "")."""
        if self.stopped:
            return ""
        if isinstance(new_token_ids, int):
            new_token_ids = [new_token_ids]
        chunks = []
        for token_id in new_token_ids:
            if self._skip_special and self._tokenizer.is_special(token_id):
                continue
            raw = self._tokenizer.id_to_bytes(token_id)
            if self._strip_space and raw:
                raw = raw[1:] if raw.startswith(b" ") else raw
                self._strip_space = False
            chunks.append(raw)
        return self._release(self._utf8.decode(b"".join(chunks), final=False), final=False)

    def finish(self) -> str:
        """The request is over: release what was held back (broken trailing bytes become U+FFFD)."""
        if self.stopped:
            return ""
        return self._release(self._utf8.decode(b"", final=True), final=True)

    def _release(self, new_text: str, final: bool) -> str:
        window = self._held + new_text
        keep = 0
        if self._stops and window:
            hit = self._first_stop(window)
            if hit is not None:
                start, stop = hit
                self.stopped, self.stop_reason = True, stop
                window = window[:start + len(stop) if self._include_stop else start]
            elif not final:
                keep = self._stop_prefix_len(window)
        delta = window[:len(window) - keep]
        self._held = window[len(window) - keep:]
        if delta:
            self._parts.append(delta)
        return delta

    def _first_stop(self, window: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop that ends first in window (ties: the longer one)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, window: str) -> int:
        """Length of the longest suffix of window that is a proper prefix of some stop string."""
        keep = 0
        n = len(window)
        for stop in self._stops:
            first = stop[0]
            i = window.find(first, max(0, n - len(stop) + 1))
            while i != -1 and n - i > keep:
                if stop.startswith(window[i:]):
                    keep = n - i
                    break
                i = window.find(first, i + 1)
        return keep
