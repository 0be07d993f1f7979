"""The prompt count of an upstream engine whose deployment names no `tokenizer`: an estimate.

The gateway counts a prompt before the call (the context check, the router, the token rate limit,
the budget hold all need a number). Without the upstream model's own tokenizer, it renders the
chat with a generic template and counts one token per `BYTES_PER_TOKEN` bytes of UTF-8, rounded
up: close to BPE tokenizers on English prose and code, and larger on most other text. The
estimate only reserves: the usage record and the limiter settle with the counts the upstream
reports (and say "estimated" when it reports none).

It offers the part of engines.text.tokenizer.Tokenizer that counting uses (encode, chat_template,
bos/eos, vocab_size); ids are placeholders (0), never sent anywhere.
"""
from __future__ import annotations

import math

BYTES_PER_TOKEN = 4
MAX_ID = 1 << 31          # token-id prompts (text completions) pass through as the client gave them


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)


class EstimateTokenizer:
    """Counts, for one engine (each engine has its own: prompts are never shared across engines by it)."""

    chat_template: str | None = None   # the generic fallback template (ChatML-like) renders the chat
    bos_token: str | None = None
    eos_token: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    strips_leading_space = False
    estimate = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * estimate_tokens(text)

    def count_tokens(self, text: str, add_special_tokens: bool = False) -> int:
        return estimate_tokens(text)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""

    def id_to_bytes(self, token_id: int) -> bytes:
        return b""

    def is_special(self, token_id: int) -> bool:
        return False

    @property
    def vocab_size(self) -> int:
        return MAX_ID

    @property
    def all_special_ids(self) -> list[int]:
        return []

    def __repr__(self) -> str:
        return f"EstimateTokenizer({BYTES_PER_TOKEN} bytes/token)"
