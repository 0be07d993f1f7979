"""The Batch API through the real openai SDK on a mock engine: upload, create, retrieve, download;
OpenAI's shapes for the batch and its output and error lines; bad lines in the error file while the
batch goes on; the batch price; cancel (within an engine step); expiry; an unreadable input; tenant
isolation."""
from __future__ import annotations

import os
import re
import time

import openai
import pytest
import redis
from batch_helpers import batch_document, batch_gateway, chat_line, client, jsonl, read_lines, tenant_key, wait_batch
from gateway_helpers import ROOT, SHARED_REDIS, delete_prefix, running_gateway, unique_prefix

from tokenyard.policies.schema import DEFAULT_BATCH_PRICE_PERCENT, Prices

PRICES = {"input": 3_000_000, "cached_input": 1_000_000, "output": 7_000_000}


@pytest.fixture(scope="module")
def srv():
    records: list = []
    with batch_gateway(output_len=5, prices=PRICES, usage_sink=records.append) as s:
        s.records = records
        yield s


def test_sdk_upload_create_retrieve_download(srv):
    c = client(srv)
    f = c.files.create(file=("requests.jsonl", jsonl([chat_line(f"q{i}", f"question {i}") for i in range(12)])),
                       purpose="batch")
    assert f.object == "file" and f.purpose == "batch" and f.filename == "requests.jsonl" and f.bytes > 0
    assert c.files.retrieve(f.id).bytes == f.bytes
    assert f.id in {x.id for x in c.files.list(purpose="batch").data}
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "nightly"})
    assert b.object == "batch" and b.status in ("validating", "in_progress") and b.metadata == {"job": "nightly"}
    assert b.request_counts.total == 12 and b.expires_at == b.created_at + 24 * 3600
    done = wait_batch(c, b.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    out = read_lines(c, done.output_file_id)
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(12)]     # input order
    first = out[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200 and first["response"]["request_id"] == f"{b.id}-0"
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "mock"
    assert body["choices"][0]["message"]["content"] and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 6     # output_len tokens, then EOS
    meta = c.files.retrieve(done.output_file_id)
    assert meta.purpose == "batch_output" and meta.filename == f"{b.id}_output.jsonl"
    assert b.id in {x.id for x in c.batches.list().data}


def test_text_completions_endpoint(srv):
    c = client(srv)
    lines = [chat_line("t0", url="/v1/completions").replace('"messages": [{"role": "user", "content": "hi"}]',
                                                            '"prompt": "Once upon"')]
    f = c.files.create(file=("t.jsonl", jsonl(lines)), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                          completion_window="24h").id)
    [line] = read_lines(c, done.output_file_id)
    assert line["response"]["body"]["object"] == "text_completion"
    assert line["response"]["body"]["choices"][0]["text"]


def test_bad_lines_go_to_the_error_file_and_the_batch_goes_on(srv):
    c = client(srv)
    lines = [chat_line("ok-1"), chat_line("bad-model", model="gpt-17"), chat_line("bad-temp", temperature=9),
             chat_line("bad-stream", stream=True), chat_line("ok-2")]
    f = c.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 2, 3)
    assert [x["custom_id"] for x in read_lines(c, done.output_file_id)] == ["ok-1", "ok-2"]
    errors = {x["custom_id"]: x["response"] for x in read_lines(c, done.error_file_id)}
    assert set(errors) == {"bad-model", "bad-temp", "bad-stream"}
    assert errors["bad-model"]["status_code"] == 404
    assert errors["bad-model"]["body"]["error"]["code"] == "model_not_found"
    assert errors["bad-temp"]["status_code"] == 400 and errors["bad-temp"]["body"]["error"]["param"] == "temperature"
    assert errors["bad-stream"]["body"]["error"]["param"] == "stream"


def test_charged_at_the_batch_price(srv):
    c = client(srv)
    f = c.files.create(file=("p.jsonl", jsonl([chat_line("priced", "a priced question")])), purpose="batch")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    rid = read_lines(c, done.output_file_id)[0]["response"]["request_id"]
    rec = next(r for r in srv.records if r.client_request_id == rid)
    prices = Prices(**PRICES)
    assert rec.cost_micros == prices.cost(rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens,
                                          DEFAULT_BATCH_PRICE_PERCENT)
    assert 0 < rec.cost_micros < prices.cost(rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)
    c.chat.completions.create(model="mock", messages=[{"role": "user", "content": "a priced question"}])
    full = srv.records[-1]
    assert full.cost_micros == prices.cost(full.prompt_tokens, full.cached_tokens, full.completion_tokens)


def test_create_refusals(srv):
    c = client(srv)
    f = c.files.create(file=("r.jsonl", jsonl([chat_line("x")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.body["code"] == "mismatched_url" and "Line 1" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_nope")
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    with pytest.raises(openai.ConflictError) as e:
        c.batches.cancel(done.id)
    assert e.value.body["code"] == "batch_not_cancellable"


def test_cancel_stops_lines_in_flight_within_a_step():
    # Each line takes ~2.5 s (50 tokens x 50 ms): a cancel must not wait for them.
    with batch_gateway({"max_in_flight": 8}, output_len=50, token_ms=50) as srv:
        c = client(srv)
        f = c.files.create(file=("slow.jsonl", jsonl([chat_line(f"s{i}") for i in range(40)])), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        engine = srv.engine()
        deadline = time.monotonic() + 10
        while engine.stats().num_running < 8:
            assert time.monotonic() < deadline, "lines never started"
            time.sleep(0.01)
        t0 = time.monotonic()
        cancelling = c.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
        while engine.stats().num_running:
            time.sleep(0.005)
        stopped_s = time.monotonic() - t0
        # One engine step is at most max_sleep_ms (20 ms) here; the rest is the HTTP round trip on a loaded machine.
        assert stopped_s < 0.5, f"lines still ran {stopped_s:.3f} s after the cancel"
        done = wait_batch(c, b.id)
        assert done.status == "cancelled" and done.cancelled_at
        counts = done.request_counts
        assert counts.total == 40 and counts.completed + counts.failed == 40 and counts.completed < 40
        out, err = read_lines(c, done.output_file_id), read_lines(c, done.error_file_id)
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"s{i}" for i in range(40))
        assert all(x["error"]["code"] == "batch_cancelled" and x["response"] is None for x in err)
        assert len(err) == counts.failed
        assert c.batches.cancel(b.id).status == "cancelled"     # cancelled already: answered as it is


def test_tenants_cannot_see_each_other(srv):
    a, b = client(srv, tenant_key(srv.prefix, "tenant-a")), client(srv, tenant_key(srv.prefix, "tenant-b"))
    f = a.files.create(file=("a.jsonl", jsonl([chat_line("secret")])), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.files.delete(f.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.files.list().data == [] and b.batches.list().data == []
    done = wait_batch(a, batch.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)
    assert read_lines(a, done.output_file_id)[0]["custom_id"] == "secret"
    assert a.files.retrieve(f.id).id == f.id


def test_expiry_answers_the_unrun_lines_batch_expired():
    with batch_gateway({"max_in_flight": 2}, output_len=40, token_ms=25) as srv:
        c = client(srv)
        f = c.files.create(file=("e.jsonl", jsonl([chat_line(f"e{i}") for i in range(10)])), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_batch(c, b.id, ("in_progress",))
        # The window ends now (as if 24 h had passed): the runner sees it within batch.poll_s.
        redis.Redis.from_url(SHARED_REDIS).hset(f"{srv.prefix}batch:{b.id}", "expires_at", int(time.time()) - 1)
        done = wait_batch(c, b.id)
        assert done.status == "expired" and done.expired_at
        assert done.request_counts.completed + done.request_counts.failed == 10
        err = read_lines(c, done.error_file_id)
        assert err and all(x["error"]["code"] == "batch_expired" for x in err)
        out = read_lines(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"e{i}" for i in range(10))


def test_unreadable_input_fails_the_batch(srv):
    c = client(srv)
    f = c.files.create(file=("gone.jsonl", jsonl([chat_line("g")])), purpose="batch")
    os.remove(os.path.join(srv.data_dir, "dev", f.id))       # the disk lost it behind the gateway's back
    done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert done.status == "failed" and done.failed_at
    assert done.errors.data[0].code == "invalid_input_file" and f.id in done.errors.data[0].message


def test_the_policys_batch_price_percent_and_prices_apply(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nengines: {small: mock, large: mock2}\nbatch_price_percent: 30\n"
                      "prices:\n  mock: {input: 0.5, cached_input: 0.1, output: 2}\n"
                      "  mock2: {input: 1, cached_input: 0.5, output: 4}\n")
    prefix = unique_prefix("batch-policy")
    doc = batch_document(prefix, str(tmp_path / "data"), output_len=4)
    doc["engines"]["mock2"] = {"type": "mock", "model": str(ROOT / "models" / "demo-small"), "output_len": 4}
    doc["routing"] = {"small": "mock", "large": "mock2"}
    doc["policy"] = str(policy)
    records: list = []
    try:
        with running_gateway(doc, usage_sink=records.append) as srv:
            c = client(srv)
            f = c.files.create(file=("p.jsonl", jsonl([chat_line("p0", "policy priced")])), purpose="batch")
            done = wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
            rid = read_lines(c, done.output_file_id)[0]["response"]["request_id"]
            rec = next(r for r in records if r.client_request_id == rid)
            assert rec.policy_version >= 1
            policy_prices = Prices(input=500_000, cached_input=100_000, output=2_000_000)
            assert rec.cost_micros == policy_prices.cost(rec.prompt_tokens, rec.cached_tokens,
                                                         rec.completion_tokens, 30) > 0
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def test_batch_metrics(srv):
    c = client(srv)
    f = c.files.create(file=("m.jsonl", jsonl([chat_line("m0"), chat_line("m1")])), purpose="batch")
    wait_batch(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    text = srv.request("GET", "/metrics")[2].decode()
    for name in ("tokenyard_batch_runs", "tokenyard_batch_lines_in_flight", "tokenyard_batch_line_limit",
                 "tokenyard_batch_loop_lag_seconds"):
        assert f"\n{name} " in text, name
    completed = float(re.search(r'^tokenyard_batch_lines_total{outcome="completed"} (\S+)$', text, re.M).group(1))
    assert completed >= 2
