"""Context that fits (tokenyard/gateway/prompt/context_trim.py): the oldest turns go, never the system message
nor the latest turn, and no more turns go than needed."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenyard.gateway.prompt.context_trim import ContextTooLong, trim_to_fit


def count(messages: list[dict]) -> int:
    # A stand-in for the chat template: 3 tokens of framing per message plus one per word.
    return sum(3 + len(m["content"].split()) for m in messages)


def msg(role: str, words: int, tag: str = "") -> dict:
    return {"role": role, "content": " ".join([tag or role] * words)}


def test_under_the_limit_is_untouched():
    messages = [msg("system", 5), msg("user", 5)]
    kept, dropped = trim_to_fit(messages, count, 100)
    assert kept is messages and dropped == 0


def test_drops_oldest_turns_first_and_keeps_system_and_latest():
    messages = [msg("system", 4, "sys"), msg("user", 20, "u1"), msg("assistant", 20, "a1"),
                msg("user", 20, "u2"), msg("assistant", 20, "a2"), msg("user", 5, "u3")]
    limit = count(messages) - 30          # one turn (46 tokens) is enough
    kept, dropped = trim_to_fit(messages, count, limit)
    assert [m["content"].split()[0] for m in kept] == ["sys", "u2", "a2", "u3"]
    assert dropped == 46 and count(kept) <= limit


def test_a_tool_call_never_loses_its_result():
    call = {"role": "assistant", "content": "calling", "tool_calls": [{"id": "c1"}]}
    result = {"role": "tool", "content": "42", "tool_call_id": "c1"}
    messages = [msg("system", 2), msg("user", 10, "old"), call, result, msg("assistant", 10, "said"),
                msg("user", 3, "new")]
    kept, _ = trim_to_fit(messages, count, count(messages) - 5)
    assert call not in kept and result not in kept     # the whole old turn went together
    assert kept[-1]["content"].startswith("new")


def test_messages_after_the_last_user_turn_stay():
    # The turn being answered: the user's question, the assistant's tool call and its result.
    messages = [msg("user", 30, "old"), msg("user", 3, "ask"),
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
                {"role": "tool", "content": "result", "tool_call_id": "c"}]
    kept, dropped = trim_to_fit(messages, count, count(messages) - 10)
    assert kept == messages[1:] and dropped == 33


def test_cannot_fit_and_no_trim_are_errors_naming_the_numbers():
    messages = [msg("system", 50), msg("user", 5, "a"), msg("user", 50, "b")]
    with pytest.raises(ContextTooLong) as e:
        trim_to_fit(messages, count, 60)
    assert e.value.tokens == 106 and e.value.limit == 60 and e.value.trimmed
    assert "106" in str(e.value) and "60" in str(e.value)
    with pytest.raises(ContextTooLong) as e:
        trim_to_fit(messages, count, 100, trim=False)
    assert not e.value.trimmed and e.value.tokens == 114


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ROLES, st.integers(1, 40)), min_size=1, max_size=30), st.integers(1, 600))
def test_properties(spec, limit):
    # At least one word each: the content carries the message's index, so no two messages are equal.
    messages = [msg(role, words, f"{role}{i}") for i, (role, words) in enumerate(spec)]
    calls = []

    def counting(m):
        calls.append(1)
        return count(m)

    try:
        kept, dropped = trim_to_fit(messages, counting, limit)
    except ContextTooLong:
        # Only when even the messages that always stay are over the limit.
        last_user = max((i for i, (r, _) in enumerate(spec) if r == "user"), default=len(spec))
        floor = [m for i, m in enumerate(messages) if m["role"] == "system" or i >= last_user]
        assert count(floor) > limit
        return
    assert count(kept) <= limit and dropped == count(messages) - count(kept)
    assert [m for m in messages if m in kept] == kept                       # order kept, nothing new
    assert all(m in kept for m in messages if m["role"] == "system")
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if users:
        assert all(m in kept for m in messages[users[-1]:])                 # the latest turn stays
    if dropped:
        # Minimal: giving back the last turn that went would not fit.
        gone = [i for i, m in enumerate(messages) if m not in kept]
        starts = [i for i in gone if messages[i]["role"] == "user"]
        start = starts[-1] if starts else gone[0]
        restored = [m for i, m in enumerate(messages) if m in kept or (i in gone and i >= start)]
        assert count(restored) > limit
    assert len(calls) <= 3 + 2 * max(1, len(messages)).bit_length()       # bisection, not one per turn

