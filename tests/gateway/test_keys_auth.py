"""API keys: the CLI, hashing at rest, 401 for bad and revoked keys, 429 the SDK honours (real Redis)."""
from __future__ import annotations

import json
import time

import openai
import pytest
import redis
import yaml
from gateway_helpers import SHARED_REDIS, mock_deployment, running_gateway

from tokenyard.cli import main as cli
from tokenyard.gateway.auth.api_keys import KeyStore, hash_key, key_id_of

MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
def store(prefix):
    client = redis.Redis.from_url(SHARED_REDIS)
    yield KeyStore(client, prefix)
    client.close()


def _doc(prefix: str, **rate_limits) -> dict:
    return {**mock_deployment(max_sleep_ms=5), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
            "rate_limits": rate_limits}


def test_cli_create_list_revoke_and_nothing_in_plaintext(tmp_path, prefix, capsys):
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump(_doc(prefix)))
    assert cli.main(["keys", "--config", str(cfg), "create", "--tenant", "acme", "--name", "ci",
                     "--priority", "batch", "--tpm", "5000"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("ty-") and len(key) >= 40
    assert cli.main(["keys", "--config", str(cfg), "create", "--tenant", "ops", "--admin"]) == 0
    admin_key = capsys.readouterr().out.strip()
    assert cli.main(["keys", "--config", str(cfg), "list", "--json"]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["tenant"], r["role"], r["priority"]) for r in listed} == {("acme", "user", "batch"),
                                                                          ("ops", "admin", "interactive")}
    acme = next(r for r in listed if r["tenant"] == "acme")
    assert acme["key_id"] == key_id_of(hash_key(key)) and acme["tpm"] == 5000 and "key_hash" not in acme
    # Scan every key and value under the prefix: neither key appears in plaintext, only hashes.
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        dump = b""
        for name in client.scan_iter(match=prefix + "*"):
            kind = client.type(name)
            dump += name + b"\n"
            if kind == b"hash":
                dump += b"\n".join(k + b"=" + v for k, v in client.hgetall(name).items())
            elif kind == b"set":
                dump += b"\n".join(client.smembers(name))
            elif kind == b"string":
                dump += client.get(name)
        assert dump and hash_key(key).encode() in dump
        for secret in (key, admin_key):
            assert secret.encode() not in dump and secret[3:].encode() not in dump
    finally:
        client.close()
    assert cli.main(["keys", "--config", str(cfg), "revoke", acme["key_id"]]) == 0
    assert cli.main(["keys", "--config", str(cfg), "list"]) == 0
    table = capsys.readouterr().out
    assert "revoked" in table and acme["key_id"] in table
    assert cli.main(["keys", "--config", str(cfg), "revoke", "0000000000000000"]) == 1


def test_sdk_401_for_bad_and_revoked_keys(prefix, store):
    key, rec = store.create("acme", name="sdk")
    with running_gateway(_doc(prefix)) as srv:
        base = srv.base_url + "/v1"
        ok = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
        r = ok.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        bad = openai.OpenAI(base_url=base, api_key=key[:-2] + "xx", max_retries=0, timeout=10)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model="mock", messages=MESSAGES)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        # Revocation reaches the running gateway through pub/sub, although the record is cached.
        store.revoke(rec.key_id)
        deadline = time.monotonic() + 5
        while True:
            try:
                ok.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=1)
            except openai.AuthenticationError as err:
                assert "revoked" in err.body["message"]
                break
            assert time.monotonic() < deadline, "revoked key still accepted after 5 s"
            time.sleep(0.05)
        with pytest.raises(openai.AuthenticationError):
            ok.models.list()


def test_sdk_honours_retry_after_on_429_then_succeeds(prefix, store):
    # 2 requests per 1 s window: a burst of 2, then one every 0.5 s.
    key, _ = store.create("slow", rpm=2, tpm=0)
    with running_gateway(_doc(prefix, window_s=1.0)) as srv:
        base = srv.base_url + "/v1"
        no_retry = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=10)
        raw = no_retry.chat.completions.with_raw_response.create(model="mock", messages=MESSAGES, max_tokens=2)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == "1"
        assert raw.headers["x-ratelimit-reset-requests"].endswith("ms")
        no_retry.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as e:
            no_retry.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=2)
        headers = e.value.response.headers
        wait_ms = int(headers["retry-after-ms"])
        assert 100 < wait_ms <= 500 and headers["retry-after"] == "1"
        assert e.value.body["code"] == "rate_limit_exceeded" and e.value.body["type"] == "rate_limit_error"
        # With retries, the SDK waits what retry-after-ms says (not its own backoff) and then succeeds.
        retrying = openai.OpenAI(base_url=base, api_key=key, max_retries=3, timeout=10)
        t0 = time.monotonic()
        r = retrying.chat.completions.create(model="mock", messages=MESSAGES, max_tokens=2)
        took = time.monotonic() - t0
        assert r.usage.completion_tokens == 2
        assert 0.1 < took < 1.5, took
        text = srv.request("GET", "/metrics")[2].decode()
        assert 'tokenyard_rate_limited_total{engine="mock",reason="requests"}' in text


def test_dev_admin_key_is_made_and_shown_on_the_first_start_only(store):
    key, rec = store.ensure_dev_key(None)
    assert key is not None and rec.role == "admin" and rec.tenant == "dev" and rec.matches(hash_key(key))
    again, same = store.ensure_dev_key(None)
    assert again is None and same.key_id == rec.key_id          # not shown twice, not made twice
    configured, crec = store.ensure_dev_key("my-dev-key")      # TOKENYARD_DEV_KEY: a record for it, admin
    assert configured == "my-dev-key" and crec.is_admin and crec.matches(hash_key("my-dev-key"))
    store.revoke(crec.key_id)
    assert store.ensure_dev_key("my-dev-key")[1].revoked is not None   # a revoked dev key stays revoked
