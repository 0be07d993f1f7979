"""The rendering step before the route plan (tokenyard/gateway/prompt/rendering.py): a request's prompt is
templated and encoded once per tokenizer however many engines routing, the context check and a
fallback look at, and a trim resets the encodings of the old messages."""
from __future__ import annotations

import pytest
from gateway_helpers import ROOT

from tokenyard.engines.text.tokenizer import Tokenizer
from tokenyard.gateway.edge.chat_request import parse_chat_request
from tokenyard.gateway.edge.completion_request import parse_completion_request
from tokenyard.gateway.edge.errors import BadRequest
from tokenyard.gateway.prompt.rendering import RenderedPrompt, tokenize


class Counting:
    """A tokenizer that counts its encodes (everything else is the demo model's)."""

    def __init__(self) -> None:
        self.inner = Tokenizer.from_dir(ROOT / "models" / "demo-small")
        self.encodes = 0

    def encode(self, text, add_special_tokens=True):
        self.encodes += 1
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_one_encoding_per_tokenizer_and_a_trim_resets_them():
    req = parse_chat_request({"model": "auto", "messages": [{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": "first question"},
                                                            {"role": "user", "content": "second question"}]})
    a, b = Counting(), Counting()
    prompt = RenderedPrompt(req)
    ids = prompt.ids(a)
    assert prompt.ids(a) is ids and a.encodes == 1                  # cached for the same tokenizer
    assert prompt.ids(b) == ids and b.encodes == 1                  # another object: its own encoding
    kept = [req.messages[0], req.messages[2]]
    kept_ids = tokenize(a.inner, kept)
    prompt.replace_messages(kept, a, kept_ids)
    assert req.messages == kept and prompt.ids(a) is kept_ids and a.encodes == 1
    assert prompt.ids(b) == kept_ids and b.encodes == 2             # b's old encoding is gone


def test_a_text_prompt_is_encoded_as_is_and_ids_are_checked():
    tok = Tokenizer.from_dir(ROOT / "models" / "demo-small")
    req = parse_completion_request({"model": "auto", "prompt": "Once upon a time"})
    assert RenderedPrompt(req).ids(tok) == tok.encode("Once upon a time")
    bad = parse_completion_request({"model": "auto", "prompt": [1, 2, tok.vocab_size]})
    with pytest.raises(BadRequest) as e:
        RenderedPrompt(bad).ids(tok)
    assert e.value.param == "prompt"
