"""Context that fits: drop a chat's oldest turns until its prompt is within a token limit.

    kept, dropped_tokens = trim_to_fit(messages, count, max_prompt_tokens)

The policy's `context: {max_prompt_tokens, trim: keep_system_and_latest}` (per tenant or per rule)
asks for this. Long histories cost more than people expect (every turn is re-read on every
request), and most of the old turns do not change the answer, so dropping them is the cheap fix.

What is never dropped: system and developer messages (the operator's instructions), and the
latest turn: the last user message and everything after it (an assistant's tool calls and the
tool results that answer them belong to the turn that is being answered). What goes: whole
turns, oldest first; a turn is a user message and the assistant/tool messages that follow it,
so an assistant's tool call is never kept without its results or the other way round.

`count(messages)` is the prompt's token count through the model's chat template (the real
count, template tokens included). Dropping more turns never makes the prompt longer, so the
fewest turns to drop is found by bisection: O(log turns) template renderings, not one per turn.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

KEPT_ROLES = ("system", "developer")


class ContextTooLong(ValueError):
    """Even with every droppable turn gone the prompt is over the limit (or trimming is off)."""

    def __init__(self, tokens: int, limit: int, trimmed: bool) -> None:
        self.tokens, self.limit, self.trimmed = tokens, limit, trimmed
        how = ("after dropping every earlier turn (system messages and the latest turn stay)" if trimmed
               else "and the policy does not trim")
        super().__init__(f"The prompt has {tokens} tokens {how}; the policy allows at most {limit} "
                         f"prompt tokens for this request")


def _turns(messages: list[dict[str, Any]]) -> tuple[list[list[int]], list[int]]:
    """(droppable turns as lists of message indexes, oldest first; indexes always kept)."""
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages))
    turns: list[list[int]] = []
    kept: list[int] = []
    for i, m in enumerate(messages):
        if m.get("role") in KEPT_ROLES or i >= last_user:
            kept.append(i)
        elif m.get("role") == "user" or not turns:
            turns.append([i])          # a user message opens a turn (so does anything before the first)
        else:
            turns[-1].append(i)
    return turns, kept


def trim_to_fit(messages: list[dict[str, Any]], count: Callable[[list[dict[str, Any]]], int],
                limit: int, trim: bool = True, tokens: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The messages with the fewest oldest turns dropped so that count(result) <= limit, and how
    many prompt tokens that saved. tokens: count(messages) when the caller already has it.
    Raises ContextTooLong when no trimming fits (or trim is False and the prompt is over)."""
    full = count(messages) if tokens is None else tokens
    if full <= limit:
        return messages, 0
    if not trim:
        raise ContextTooLong(full, limit, trimmed=False)
    turns, _kept = _turns(messages)

    counted: dict[int, int] = {}

    def without(k: int) -> list[dict[str, Any]]:
        gone = {i for turn in turns[:k] for i in turn}
        return [m for i, m in enumerate(messages) if i not in gone]

    def tokens_without(k: int) -> int:
        if k not in counted:
            counted[k] = count(without(k))
        return counted[k]

    if not turns or tokens_without(len(turns)) > limit:
        raise ContextTooLong(tokens_without(len(turns)) if turns else full, limit, trimmed=True)
    lo, hi = 1, len(turns)            # invariant: dropping hi turns fits; fewer than lo does not
    while lo < hi:
        mid = (lo + hi) // 2
        if tokens_without(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return without(hi), full - tokens_without(hi)
