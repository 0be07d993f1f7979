"""presence_penalty, frequency_penalty, logit_bias and logprobs: the sampler's rule and the
reported log probabilities checked against the engine's own forward (tests/engine_helpers.prompt_logits),
speculation giving the same tokens, and the gateway edge (the openai SDK against the demo-small torch
engine, streamed and not; 400s naming the parameter)."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from gateway_helpers import KEY, running_gateway

from tests.engine_helpers import prompt_logits, random_prompts, run_to_completion
from tokenyard.engines import Engine, SamplingParams
from tokenyard.engines.core.sampling_params import ParamError
from tokenyard.engines.model.sampler import LogitAdjust, apply_adjustments, greedy_tokens, sample
from tokenyard.engines.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
BASE = dict(dtype="float32", progress=False, max_num_batched_tokens=64, kv_cache_memory=4 << 20)


def _adjusted(logits: torch.Tensor, out: list[int], presence: float, frequency: float,
              bias: dict[int, float]) -> torch.Tensor:
    """OpenAI's documented rule, written out token by token."""
    adj = logits.clone().double()
    for t in set(out):
        adj[t] -= frequency * out.count(t) + presence
    for t, b in bias.items():
        adj[t] += b
    return adj


def test_apply_adjustments_is_the_documented_rule_and_leaves_other_rows_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    outs = [[4, 4, 7, 9, 4], [], [1, 2]]
    adjust = [LogitAdjust(0.5, 1.25, {3: 2.0, 7: -100.0}, outs[0]), None, LogitAdjust(-1.0, 0.0, {}, outs[2])]
    got = apply_adjustments(logits, adjust)
    assert torch.equal(got[1], logits[1])
    torch.testing.assert_close(got[0].double(), _adjusted(logits[0], outs[0], 0.5, 1.25, {3: 2.0, 7: -100.0}))
    torch.testing.assert_close(got[2].double(), _adjusted(logits[2], outs[2], -1.0, 0.0, {}))


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return Engine(checkpoint_dir("llama"), **BASE)


def _generate(engine, prompt, params) -> list[int]:
    engine.add_request("one", prompt, params)
    return run_to_completion(engine)["one"]


def _greedy_reference(engine, prompt, n, presence, frequency, bias) -> list[int]:
    """Greedy decoding, one model forward per token, with the penalties applied by hand."""
    out: list[int] = []
    for _ in range(n):
        logits = prompt_logits(engine, prompt + out)[-1]
        out.append(int(_adjusted(logits, out, presence, frequency, bias).argmax()))
    return out


@pytest.mark.parametrize("presence, frequency", [(0.0, 2.0), (1.5, 0.0), (-0.5, 0.75)])
def test_penalised_greedy_matches_the_reference(engine, presence, frequency):
    # This prompt's plain greedy output repeats one token eight times: the penalties have work to do.
    prompt = random_prompts(1, 12, 12, engine.model_config.vocab_size, seed=1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    got = _generate(engine, prompt, params)
    assert got == _greedy_reference(engine, prompt, 16, presence, frequency, {})
    plain = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    if presence >= 0:
        assert len(set(got)) > len(set(plain)), (got, plain)


def test_logit_bias_forces_and_forbids(engine):
    vocab = engine.model_config.vocab_size
    prompt = random_prompts(1, 10, 10, vocab, seed=6)[0]
    forced = 17
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=3, max_tokens=8, ignore_eos=True,
                                logit_bias={forced: 100})
        assert _generate(engine, prompt, params) == [forced] * 8
    plain = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    banned = {t: -100.0 for t in set(plain)}
    got = _generate(engine, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                   logit_bias=banned))
    assert not set(got) & set(plain)
    assert got == _greedy_reference(engine, prompt, 8, 0.0, 0.0, banned)
    # A bias moves a sampled request's distribution too: its draws avoid the banned tokens.
    sampled = SamplingParams(temperature=1.0, seed=9, max_tokens=16, ignore_eos=True, logit_bias=banned)
    assert not set(_generate(engine, prompt, sampled)) & set(banned)


def test_penalised_request_batched_with_others_is_unchanged(engine):
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(4, 5, 30, vocab, seed=12)
    penalised = SamplingParams(temperature=0.8, seed=4, max_tokens=10, ignore_eos=True, frequency_penalty=1.0,
                               logit_bias={5: 3.0})
    alone = _generate(engine, prompts[0], penalised)
    engine.add_request("p", prompts[0], penalised)
    for i, p in enumerate(prompts[1:]):
        engine.add_request(f"o{i}", p, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert run_to_completion(engine)["p"] == alone


def test_speculative_engine_gives_the_same_penalised_tokens(engine, checkpoint_dir):
    prompt = random_prompts(1, 6, 6, 512, seed=2)[0] * 4      # repetitive: prompt lookup proposes drafts
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, frequency_penalty=1.0,
                            presence_penalty=0.5)
    spec = Engine(checkpoint_dir("llama"), **BASE, speculative_method="ngram", num_speculative_tokens=3)
    spec.add_request("pen", prompt, params)
    spec.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    got = run_to_completion(spec)
    assert got["pen"] == _generate(engine, prompt, params)
    assert spec.spec.stats.num_verifications > 0      # the plain request was speculated beside it


def test_params_survive_the_remote_wire_format():
    """A remote replica gets asdict(params) as JSON, whose object keys are strings."""
    import json
    from dataclasses import asdict

    sent = SamplingParams(logit_bias={5: -100.0, 12: 2.5}, presence_penalty=0.5, logprobs=3)
    back = SamplingParams.from_dict(json.loads(json.dumps(asdict(sent))))
    assert back.logit_bias == {5: -100.0, 12: 2.5} and back == sent


def test_bad_values_are_param_errors(engine):
    vocab = engine.model_config.vocab_size
    for kwargs, param in [({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"frequency_penalty": float("nan")}, "frequency_penalty"),
                          ({"logit_bias": {1: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias")]:
        with pytest.raises(ParamError) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
    with pytest.raises(ParamError) as e:
        engine.add_request("oov", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert e.value.param == "logit_bias" and str(vocab) in str(e.value)
    assert not engine.has_unfinished()


def _generate_with_logprobs(engine, prompt, params) -> tuple[list[int], list]:
    engine.add_request("lp", prompt, params)
    tokens: list[int] = []
    logprobs: list = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            logprobs.extend(out.logprobs)
    return tokens, logprobs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5),
    # Penalties, bias, temperature and top_p change the pick, never the reported (model's) distribution.
    SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=10, ignore_eos=True, logprobs=20,
                   frequency_penalty=1.0, logit_bias={7: 5.0}),
    SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=0),
])
def test_logprobs_are_the_models_log_softmax(engine, params):
    prompt = random_prompts(1, 9, 9, engine.model_config.vocab_size, seed=7)[0]
    tokens, logprobs = _generate_with_logprobs(engine, prompt, params)
    assert len(tokens) == len(logprobs) == params.max_tokens
    for i, (tok, (tid, lp, top)) in enumerate(zip(tokens, logprobs)):
        ref = torch.log_softmax(prompt_logits(engine, prompt + tokens[:i])[-1].float(), dim=-1)
        assert tid == tok and abs(lp - ref[tok].item()) < 1e-4
        assert len(top) == params.logprobs
        ref_v, ref_i = ref.topk(params.logprobs) if params.logprobs else (ref[:0], ref[:0].long())
        assert [t for t, _ in top] == ref_i.tolist()
        assert max((abs(v - r) for (_, v), r in zip(top, ref_v.tolist())), default=0.0) < 1e-4
    if params.greedy:
        assert all(top[0][0] == tid for tid, _, top in logprobs)


def test_logprobs_requests_are_not_speculated_and_match(engine, checkpoint_dir):
    prompt = random_prompts(1, 6, 6, 512, seed=2)[0] * 4
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    spec = Engine(checkpoint_dir("llama"), **BASE, speculative_method="ngram", num_speculative_tokens=3)
    got = _generate_with_logprobs(spec, prompt, params)
    want = _generate_with_logprobs(engine, prompt, params)
    assert got[0] == want[0]
    for (_, a, ta), (_, b, tb) in zip(got[1], want[1]):
        assert abs(a - b) < 1e-4 and [t for t, _ in ta] == [t for t, _ in tb]


# --- the gateway, with a real (tiny) torch engine ------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    doc = {"server": {"access_log": False},
           "engines": {"demo": {"type": "torch", "model": str(ROOT / "models" / "demo-small"), "dtype": "float32",
                                "kv_cache_memory": 8 << 20}}}
    with running_gateway(doc) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def test_sdk_logit_bias_forces_a_token(client):
    r = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, temperature=0,
                                       logit_bias={"300": 100})
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].message.content != plain.choices[0].message.content
    again = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=5, temperature=0.7, seed=1,
                                           logit_bias={"300": 100}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in again if c.choices)
    assert text == r.choices[0].message.content


def test_sdk_penalties_are_accepted_and_change_the_text(client):
    # demo-small answers briefly; -100 on its EOS (1961) forbids stopping, so 40 tokens come back.
    kw = dict(model="demo", messages=MESSAGES, max_tokens=40, temperature=0, logit_bias={"1961": -100})
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 40
    pen = client.chat.completions.create(**kw, frequency_penalty=2, presence_penalty=2)
    assert pen.choices[0].message.content != plain.choices[0].message.content


def test_sdk_reads_logprobs_streamed_and_not(client):
    kw = dict(model="demo", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
              logit_bias={"1961": -100})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    # Greedy: the picked token is the model's most likely one unless that is the EOS the bias forbids
    # (the reported distribution is the model's, before the bias); the bytes spell the reply.
    eos = Tokenizer.from_dir(ROOT / "models" / "demo-small").id_to_bytes(1961).decode()
    for c in content:
        best = c.top_logprobs[0]
        assert (best.token == c.token and abs(best.logprob - c.logprob) < 1e-6) or best.token == eos
        assert c.logprob <= best.logprob + 1e-6
    assert any(c.top_logprobs[0].token == eos for c in content)   # the bias really overrode the model
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode().strip() == r.choices[0].message.content.strip()
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    # A stop string cuts the reply: logprobs cover exactly the tokens counted, none past the stop.
    text = r.choices[0].message.content
    cut = client.chat.completions.create(**kw, stop=[text[len(text) // 2:len(text) // 2 + 2]])
    assert cut.choices[0].finish_reason == "stop"
    assert len(cut.choices[0].logprobs.content) == cut.usage.completion_tokens < 12
    plain = client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),                     # needs logprobs: true
    ({"logprobs": "yes"}, "logprobs"),
    ({"logit_bias": {"999999999": 5}}, "logit_bias"),          # outside the vocabulary
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"presence_penalty": 2.01}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
])
def test_bad_values_are_400_naming_the_parameter(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_greedy_tokens_take_the_first_maximum_as_torch_does():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 49152, generator=g)
    logits[1, 7] = logits[1, 9000] = 50.0                 # a tie: the first index wins
    logits[2, 123] = float("nan")                         # a NaN counts as the maximum, in both
    logits[3] = float("-inf")                             # nothing finite: index 0
    for rows in (logits, logits[1:3], logits.to(torch.bfloat16), logits[:, ::2]):
        assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(logits)[1:4] == [7, 123, 0]
    # the sampler's greedy rows, alone and beside a sampled row
    n = logits.shape[0]
    assert sample(logits, [True] * n, [0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n) == logits.argmax(-1).tolist()
    mixed = sample(logits, [True, False, True, True, True], [0.0, 1.0, 0.0, 0.0, 0.0], [0] * n, [1.0] * n,
                   [1] * n, [0] * n)
    assert [mixed[i] for i in (0, 2, 3, 4)] == [logits[i].argmax().item() for i in (0, 2, 3, 4)]
