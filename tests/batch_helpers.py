"""Shared pieces of the Batch API tests (tests/test_batch_*.py, tests/test_files_*.py): a gateway on
the shared Redis under a prefix of its own with a throwaway data folder, keys stored in Redis (the
runner looks a batch's key up by id, as after a restart), JSONL builders and waiting."""
from __future__ import annotations

import json
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import openai
import redis
from gateway_helpers import KEY, SHARED_REDIS, delete_prefix, mock_deployment, running_gateway, unique_prefix

from tokenyard.gateway.auth.api_keys import KeyStore

FINAL = ("completed", "failed", "cancelled", "expired")


def batch_document(prefix: str, data_dir: str, batch: dict[str, Any] | None = None,
                   **engine_options: Any) -> dict[str, Any]:
    return {**mock_deployment(**engine_options), "redis_url": SHARED_REDIS, "redis_prefix": prefix,
            "rate_limits": {"enabled": False}, "spend": {"enabled": False},
            "batch": {"data_dir": data_dir, "lease_s": 1.0, "poll_s": 0.1, **(batch or {})}}


@contextmanager
def batch_gateway(batch: dict[str, Any] | None = None, usage_sink=None, prefix: str | None = None,
                  data_dir: str | None = None, **engine_options: Any) -> Iterator[Any]:
    """A running gateway with the Batch API; its Redis keys are removed afterwards unless the caller
    gave the prefix (a restart test reuses it)."""
    own = prefix is None
    prefix = prefix or unique_prefix("batch")
    data_dir = data_dir or tempfile.mkdtemp(prefix="tytest-batch-")
    try:
        with running_gateway(batch_document(prefix, data_dir, batch, **engine_options), usage_sink=usage_sink) as srv:
            srv.prefix, srv.data_dir = prefix, data_dir
            yield srv
    finally:
        if own:
            delete_prefix(SHARED_REDIS, prefix)


def tenant_key(prefix: str, tenant: str) -> str:
    """A new key of `tenant`, stored in the gateway's Redis."""
    client = redis.Redis.from_url(SHARED_REDIS)
    try:
        key, _ = KeyStore(client, prefix).create(tenant)
    finally:
        client.close()
    return key


def client(srv: Any, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def chat_line(custom_id: str, content: str = "hi", url: str = "/v1/chat/completions", **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "mock", "messages": [{"role": "user", "content": content}], **body}})


def jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def wait_batch(c: openai.OpenAI, batch_id: str, statuses: tuple[str, ...] = FINAL, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.status} ({b.request_counts}) after {timeout} s")
        time.sleep(0.05)


def read_lines(c: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in c.files.content(file_id).text.splitlines()]
