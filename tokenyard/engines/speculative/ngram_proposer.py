"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. No model, nearly free, and strong wherever the output repeats its input (copying,
quoting, editing, extracting). Tries the longest n first: a longer match is a better predictor."""
from __future__ import annotations


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose_one(self, tokens: list[int], k: int) -> list[int]:
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            tail = tokens[n_tokens - n:]
            first = tail[0]
            # Scan backwards so the most recent match wins (closest context, usually best).
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start] == first and tokens[start:start + n] == tail:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return follow
        return []
