"""The bulk pool (deployment `pools.bulk`): batch lines routed to an engine run on its bulk engine
(the same model with its own settings), billed at the routed engine's prices times the batch
percent; interactive requests never run there; bad pool settings stop the start naming the key."""
from __future__ import annotations

import tempfile

import openai
import pytest
from batch_helpers import batch_document, chat_line, client, jsonl, read_lines, wait_batch
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix

from tokenyard.gateway.config.deployment import DeploymentError, parse_deployment
from tokenyard.policies.schema import DEFAULT_BATCH_PRICE_PERCENT, Prices

MODEL = str(ROOT / "models" / "demo-small")
PRICES = {"input": 2_000_000, "cached_input": 500_000, "output": 8_000_000}


def pooled_document(prefix: str) -> dict:
    doc = batch_document(prefix, tempfile.mkdtemp(prefix="tytest-batch-"), output_len=3)
    doc["engines"] = {
        "mock": {"type": "mock", "model": MODEL, "output_len": 3, "prices": PRICES},
        # The bulk engine: the same model, more sequences at once, its own (here: zero) prices.
        "mock-bulk": {"type": "mock", "model": MODEL, "output_len": 3, "max_num_seqs": 512},
    }
    doc["pools"] = {"bulk": {"mock": "mock-bulk"}}
    return doc


@pytest.fixture(scope="module")
def srv():
    prefix = unique_prefix("batch-pool")
    records: list = []
    try:
        with running_gateway(pooled_document(prefix), usage_sink=records.append) as s:
            s.records = records
            yield s
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_batch_lines_run_on_the_bulk_engine_at_the_routed_engines_batch_price(srv):
    c = client(srv)
    f = c.files.create(file=("p.jsonl", jsonl([chat_line(f"b{i}") for i in range(6)])), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert done.request_counts.completed == 6
    out = read_lines(c, done.output_file_id)
    assert {x["response"]["body"]["model"] for x in out} == {"mock-bulk"}
    ran = [r for r in srv.records if r.client_request_id.startswith(done.id)]
    assert len(ran) == 6 and {r.engine for r in ran} == {"mock-bulk"}
    prices = Prices(**PRICES)
    for r in ran:
        assert r.cost_micros == prices.cost(r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                                            DEFAULT_BATCH_PRICE_PERCENT) > 0


def test_interactive_requests_never_run_on_the_bulk_engine(srv):
    c = client(srv)
    with pytest.raises(openai.NotFoundError) as e:     # not a model interactive clients can name
        c.chat.completions.create(model="mock-bulk", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}])
    assert r.model == "mock"


@pytest.mark.parametrize("pools, message", [
    ({"bulk": {"nope": "mock-bulk"}}, "pools.bulk.nope: 'nope' is not under engines"),
    ({"bulk": {"mock": "nope"}}, "pools.bulk.mock must name an engine under engines"),
    ({"bulk": {"mock": "mock"}}, "cannot be both a routed engine and a bulk engine"),
    ({"bulk": {"mock": "other-model"}}, "a bulk engine runs the same model"),
    ({"fast": {}}, "unknown key(s) pools.fast"),
])
def test_bad_pools_are_refused_naming_the_key(pools, message):
    doc = pooled_document("tytest:x:")
    doc["engines"]["other-model"] = {"type": "mock", "model": str(ROOT / "models" / "demo-large")}
    doc["pools"] = pools
    with pytest.raises(DeploymentError) as e:
        parse_deployment(doc, base_dir=ROOT)
    assert message in str(e.value)


def test_a_bulk_engine_cannot_serve_auto_routing():
    doc = pooled_document("tytest:x:")
    doc["routing"] = {"small": "mock-bulk", "large": "mock"}
    with pytest.raises(DeploymentError, match="routing.small names 'mock-bulk', an engine reserved for batch work"):
        parse_deployment(doc, base_dir=ROOT)


@pytest.mark.parametrize("batch, message", [
    ({"idle_share": 1.5}, "batch.idle_share must be in (0, 1]"),
    ({"max_in_flight": 0}, "batch.max_in_flight must be a positive integer"),
    ({"lease_s": "long"}, "batch.lease_s must be a number > 0"),
    ({"colour": "blue"}, "unknown key(s) batch.colour"),
])
def test_bad_batch_settings_are_refused_naming_the_key(batch, message):
    doc = pooled_document("tytest:x:")
    doc["batch"] = batch
    with pytest.raises(DeploymentError) as e:
        parse_deployment(doc, base_dir=ROOT)
    assert message in str(e.value)


def test_a_policy_rule_pinning_the_bulk_engine_is_refused_for_interactive_requests(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nengines: {small: mock, large: mock-bulk}\n"
                      "prices:\n  mock: {input: 1, cached_input: 1, output: 1}\n"
                      "  mock-bulk: {input: 1, cached_input: 1, output: 1}\n"
                      "rules:\n  - name: to-bulk\n    match: {}\n    action: {pin: mock-bulk}\n")
    prefix = unique_prefix("batch-pool-policy")
    doc = pooled_document(prefix)
    doc["policy"] = str(policy)
    try:
        with running_gateway(doc) as s:
            with pytest.raises(openai.BadRequestError) as e:
                client(s).chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}])
            assert e.value.body["code"] == "model_reserved_for_batch"
    finally:
        delete_prefix(SHARED_REDIS, prefix)
