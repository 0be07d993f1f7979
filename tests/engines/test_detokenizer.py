"""tokenyard.engines.text.detokenizer: streamed deltas are whole characters, add up to the text, and obey stops."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_factory import build_byte_fallback_dir, build_byte_level_dir

from tokenyard.engines.core.errors import RequestError
from tokenyard.engines.text.detokenizer import IncrementalDetokenizer
from tokenyard.engines.text.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "emoji 😀😃 🎉 👍🏽 👨‍👩‍👧‍👦 ❤️ 🚀 done",
    "mixed Ελληνικά עברית 東京 안녕 ∑x² ≈ π",
    "  spaces\t\ttabs\n\nnewlines  ",
]


@pytest.fixture(scope="session")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("detok")
    return {"byte_level": Tokenizer.from_dir(build_byte_level_dir(root / "bl")),
            "byte_fallback": Tokenizer.from_dir(build_byte_fallback_dir(root / "bf"))}


KINDS = ["byte_level", "byte_fallback"]


def stream(tok, ids, chunk_sizes=(1,), **options):
    """Feed ids in chunks of the given sizes (cycled); return the detokenizer and every delta."""
    det = IncrementalDetokenizer(tok, **options)
    deltas, i, k = [], 0, 0
    while i < len(ids):
        size = max(1, chunk_sizes[k % len(chunk_sizes)])
        deltas.append(det.add(ids[i:i + size]))
        i, k = i + size, k + 1
    deltas.append(det.finish())
    return det, deltas


def expected_cut(text, stops, include):
    """Reference: read text one character at a time; the first stop to be complete ends it
    (when two complete at once, the longer); the text is cut before it (after it with include)."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text.endswith(s, 0, end)]
        if done:
            stop = max(done, key=len)
            return text[:end] if include else text[:end - len(stop)], stop
    return text, None


def token_spans(tok, ids):
    """Byte offsets (start, end) of every token in the concatenated output."""
    spans, pos = [], 0
    for i in ids:
        n = len(tok.id_to_bytes(i))
        spans.append((pos, pos + n))
        pos += n
    return spans


@pytest.mark.parametrize("kind", KINDS)
def test_some_tokens_really_split_characters(toks, kind):
    tok = toks[kind]
    ids = tok.encode(TEXTS[1] + TEXTS[2], add_special_tokens=False)
    broken = 0
    for i in ids:
        try:
            tok.id_to_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            broken += 1
    assert broken >= 5  # otherwise the U+FFFD tests below would prove nothing


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunks", [(1,), (2, 3), (100,)])
def test_deltas_are_whole_characters_and_add_up(toks, kind, text, chunks):
    tok = toks[kind]
    ids = tok.encode(text + "<|eot_id|>" if kind == "byte_level" else text)
    det, deltas = stream(tok, ids, chunks)
    assert "".join(deltas) == det.text == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)
    assert not det.stopped and det.stop_reason is None


def test_special_tokens_kept_when_asked(toks):
    tok = toks["byte_level"]
    ids = tok.encode("hi<|eot_id|>")
    det, deltas = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "<|begin_of_text|>hi<|eot_id|>" == tok.decode(ids)


def test_leading_space_follows_decode_without_prompt_and_is_kept_after_one(toks):
    tok = toks["byte_fallback"]
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.id_to_bytes(ids[0]).startswith(b" ")
    assert stream(tok, ids)[0].text == tok.decode(ids) == "Hello world"
    # After a prompt the "▁" of the first output token is a real space between words.
    assert stream(tok, ids, prompt_token_ids=[1, 42])[0].text == " Hello world"


def test_stop_spanning_several_tokens_is_cut_exactly(toks):
    tok = toks["byte_level"]
    text, stop = "The quick brown fox jumps over the lazy dog.", "brown fox jumps"
    ids = tok.encode(text, add_special_tokens=False)
    start = len(text[:text.index(stop)].encode())
    inside = [s for s in token_spans(tok, ids) if s[0] < start + len(stop.encode()) and s[1] > start]
    assert len(inside) >= 3
    det, deltas = stream(tok, ids, stop=[stop])
    assert "".join(deltas) == det.text == "The quick "
    assert det.stopped and det.stop_reason == stop
    assert det.add(ids) == "" and det.finish() == "" and det.text == "The quick "
    det, deltas = stream(tok, ids, stop=[stop], include_stop_str_in_output=True)
    assert "".join(deltas) == "The quick brown fox jumps"


@pytest.mark.parametrize("kind", KINDS)
def test_stop_made_of_split_characters(toks, kind):
    tok = toks[kind]
    text = "价格是😀😃，好吗"
    ids = tok.encode(text, add_special_tokens=False)
    det, deltas = stream(tok, ids, stop=["😀😃"])
    assert "".join(deltas) == "价格是" and det.stop_reason == "😀😃"
    assert not any("\ufffd" in d for d in deltas)


def test_text_that_only_looked_like_a_stop_is_released(toks):
    tok = toks["byte_level"]
    ids = tok.encode("brown fox and brown cow", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, stop=["brown cat"])
    deltas = [det.add([i]) for i in ids]
    assert "brown" not in deltas[0]  # "brown" waits: it may begin "brown cat"
    deltas.append(det.finish())
    assert "".join(deltas) == "brown fox and brown cow" and not det.stopped


def test_held_back_text_stays_shorter_than_the_longest_stop(toks):
    tok = toks["byte_level"]
    stops = ["the lazy cat", "ox!"]
    det = IncrementalDetokenizer(tok, stop=stops)
    for i in tok.encode(" ".join(TEXTS) * 3, add_special_tokens=False):
        det.add([i])
        assert len(det._held) < max(map(len, stops))


@pytest.mark.parametrize("stops,text,want,reason", [
    (["lazy dog", "fox"], "quick fox lazy dog", "quick ", "fox"),
    (["abc", "b"], "xabc", "xa", "b"),     # "b" is complete before "abc"
    (["bc", "abc"], "xabcd", "x", "abc"),  # complete at the same time: the longer wins
    (["", "zzz"], "no stop here", "no stop here", None),
])
def test_which_stop_wins(toks, stops, text, want, reason):
    tok = toks["byte_level"]
    det, deltas = stream(tok, tok.encode(text, add_special_tokens=False), (1, 4), stop=stops)
    assert ("".join(deltas), det.stop_reason) == (want, reason)


def test_incomplete_character_becomes_replacement_only_at_finish(toks):
    tok = toks["byte_level"]
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = next(k for k in range(len(ids), 0, -1)
               if b"".join(tok.id_to_bytes(i) for i in ids[:k]).endswith((b"\xf0", b"\xf0\x9f", b"\xf0\x9f\x98")))
    det = IncrementalDetokenizer(tok)
    assert det.add(ids[:cut]) == "ok "
    assert det.finish() == "\ufffd" and det.text == "ok \ufffd"


def test_bad_stop_strings_are_request_errors(toks):
    with pytest.raises(RequestError):
        IncrementalDetokenizer(toks["byte_level"], stop=[3])


PIECES = list("ab c\n世界😀é") + [" the", "<|eot_id|>", "ab😀"]


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_texts_and_stops(toks, kind, data):
    tok = toks[kind]
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=25), label="pieces"))
    ids = tok.encode(text, add_special_tokens=False)
    plain = tok.decode(ids, skip_special_tokens=True)
    stops = []
    for _ in range(data.draw(st.integers(0, 3), label="n_stops")):
        if plain and data.draw(st.booleans(), label="substring"):
            a = data.draw(st.integers(0, len(plain) - 1), label="a")
            b = data.draw(st.integers(a + 1, min(len(plain), a + 6)), label="b")
            stops.append(plain[a:b])
        else:
            stops.append(data.draw(st.text(alphabet="ab c世😀", min_size=1, max_size=4), label="stop"))
    include = data.draw(st.booleans(), label="include")
    chunks = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="chunks"))
    det, deltas = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
    want, reason = expected_cut(plain, stops, include)
    assert "".join(deltas) == det.text == want
    assert det.stopped == (reason is not None) and det.stop_reason == reason
    assert not any("\ufffd" in d for d in deltas)
