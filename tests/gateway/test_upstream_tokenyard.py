"""An upstream engine (type: openai) that is a real OpenAI-compatible server: a second Tokenyard
gateway serving the demo model (torch, float32). The openai SDK drives the front gateway; every reply, stream and
usage figure must be the upstream's, under the front's id and engine name, and the spend record
must price the upstream's reported usage (issue 48)."""
from __future__ import annotations

import pytest
from gateway_helpers import KEY, ROOT, running_gateway

openai = pytest.importorskip("openai")

EOS = "1961"        # the demo model's end of sequence, held back where a test counts tokens
PRICES = {"input": 1_000_000, "cached_input": 500_000, "output": 2_000_000}


def front_doc(upstream_url: str, **extra) -> dict:
    return {"server": {"access_log": False},
            "engines": {"big": {"type": "openai", "base_urls": [upstream_url + "/v1"], "upstream_model": "demo",
                                "api_key_env": "TY_TEST_UPSTREAM_KEY", "prices": PRICES, **extra}}}


@pytest.fixture(scope="module")
def pair():
    mp = pytest.MonkeyPatch()
    mp.setenv("TY_TEST_UPSTREAM_KEY", KEY)      # the upstream gateway's dev key
    records = []
    try:
        demo = {"type": "torch", "model": str(ROOT / "models" / "demo-small"), "dtype": "float32",
                "kv_cache_memory": 8 << 20}
        with running_gateway({"server": {"access_log": False}, "engines": {"demo": demo}}) as up:
            with running_gateway(front_doc(up.base_url), usage_sink=records.append) as front:
                client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=KEY, max_retries=0)
                yield up, front, client, records
    finally:
        mp.undo()


def test_chat_non_streamed_is_the_upstreams_answer(pair):
    up, front, client, records = pair
    r = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=8, temperature=0, seed=3)
    direct = openai.OpenAI(base_url=up.base_url + "/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0, seed=3)
    assert r.model == "big" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == direct.choices[0].message.content
    assert r.usage.prompt_tokens == direct.usage.prompt_tokens
    assert r.usage.completion_tokens == direct.usage.completion_tokens
    rec = records[-1]
    assert rec.engine == "big" and rec.status == "ok" and not rec.usage_estimated
    assert (rec.prompt_tokens, rec.completion_tokens) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert rec.cost_micros == (rec.prompt_tokens * PRICES["input"] + rec.completion_tokens * PRICES["output"]) // 10**6
    assert rec.upstream_deployment.startswith("127.0.0.1:") and rec.upstream_attempts == 1


def test_chat_streamed_relays_chunks_and_usage(pair):
    _, _, client, records = pair
    stream = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "stream please"}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text and len(usage) == 1 and 1 <= usage[0].completion_tokens <= 6
    assert all(c.model == "big" for c in chunks) and len({c.id for c in chunks}) == 1
    rec = records[-1]
    assert rec.stream and rec.completion_tokens == usage[0].completion_tokens
    assert rec.prompt_tokens == usage[0].prompt_tokens


def test_stream_without_include_usage_hides_the_usage_chunk_but_bills_it(pair):
    _, _, client, records = pair
    chunks = list(client.chat.completions.create(model="big", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=5, stream=True, logit_bias={EOS: -100}))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    assert records[-1].completion_tokens == 5 and not records[-1].usage_estimated


def test_text_completions_pass_through(pair):
    _, _, client, records = pair
    r = client.completions.create(model="big", prompt="Once upon", max_tokens=4, logit_bias={EOS: -100})
    assert r.model == "big" and r.choices[0].text and r.usage.completion_tokens == 4
    assert records[-1].completion_tokens == 4


def test_n_and_logprobs_pass_through(pair):
    _, _, client, _ = pair
    r = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       n=2, logprobs=True, top_logprobs=2, seed=1, logit_bias={EOS: -100})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    assert all(len(c.logprobs.content) == 3 for c in r.choices)


def test_upstream_refusal_is_a_400_naming_the_engine(pair):
    _, _, client, _ = pair
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       logit_bias={"999999": 5})
    assert "big" in e.value.message and "127.0.0.1" not in e.value.message


def test_models_lists_the_upstream_engine(pair):
    _, _, client, _ = pair
    assert "big" in [m.id for m in client.models.list()]


def test_anthropic_messages_through_an_upstream_engine(pair):
    """A Messages request routed to an upstream engine: its chat reply and chunks shown in Anthropic's
    shapes (tokenyard/gateway/http/messages_upstream.py), billed from the upstream's usage."""
    anthropic = pytest.importorskip("anthropic")
    _, front, _, records = pair
    client = anthropic.Anthropic(base_url=front.base_url, api_key=KEY, max_retries=0)
    m = client.messages.create(model="big", max_tokens=6, messages=[{"role": "user", "content": "hello"}],
                               extra_body={"temperature": 0})
    assert m.type == "message" and m.model == "big" and m.content and m.content[0].type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens >= 1
    rec = records[-1]
    assert rec.engine == "big" and rec.api == "messages" and rec.completion_tokens == m.usage.output_tokens
    with client.messages.stream(model="big", max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "".join(b.text for b in final.content if b.type == "text") and final.usage.output_tokens >= 1
    assert records[-1].api == "messages" and records[-1].stream
