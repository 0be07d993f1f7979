"""Traffic classes through the gateway (mock engines): a request's service_tier / priority, the
policy's tenant weights in the admission queue, and the policy's context limit (trimming)."""
from __future__ import annotations

import threading
import time
from pathlib import Path

from gateway_helpers import ROOT, add_key, mock_deployment, running_gateway

MSG = [{"role": "user", "content": "hi"}]
MODEL = str(ROOT / "models" / "demo-small")

POLICY = """\
version: 1
engines: {small: small, large: large}
prices:
  small: {input: 0.1, cached_input: 0.05, output: 0.4}
  large: {input: 1, cached_input: 0.5, output: 4}
tenants:
  heavy: {weight: 3}
  light: {weight: 1}
  short: {context: {max_prompt_tokens: 60}}
  strict: {context: {max_prompt_tokens: 60, trim: none}}
"""


def _two_engines(tmp_path: Path, **engine: object) -> dict:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    opts = {"type": "mock", "model": MODEL, "prices": {"input": 1, "output": 1}, **engine}
    return {"server": {"access_log": False}, "engines": {"small": dict(opts), "large": dict(opts)},
            "routing": {"small": "small", "large": "large"}, "policy": str(policy),
            "admission": {"max_running": 1, "tick_ms": 2, "max_concurrent_per_tenant": 0}}


def _record_engine(srv, name: str = "mock") -> list[str]:
    """Client request ids in the order the engine receives them."""
    eng = srv.engine(name).engine
    seen: list[str] = []
    original = eng.add_request

    def add_request(request_id, *args, **kwargs):
        seen.append(request_id.rsplit("-", 1)[0])
        return original(request_id, *args, **kwargs)

    eng.add_request = add_request
    return seen


def _post(srv, items: list[tuple[str, str, dict]], model: str = "mock", gap: float = 0.012) -> list[threading.Thread]:
    threads = []
    for rid, key, extra in items:
        body = {"model": model, "messages": MSG, "max_tokens": 3, **extra}
        t = threading.Thread(target=srv.chat, args=(body, {"Authorization": f"Bearer {key}", "x-request-id": rid}))
        t.start()
        threads.append(t)
        time.sleep(gap)
    return threads


def _blocker(srv, model: str = "mock") -> threading.Thread:
    """Holds the engine's one slot (80 tokens x 5 ms) while the others queue."""
    t = threading.Thread(target=srv.chat, args=({"model": model, "messages": MSG, "max_tokens": 80},
                                                 {"x-request-id": "blk"}))
    t.start()
    time.sleep(0.03)
    return t


def test_flex_lowers_a_request_and_priority_never_raises_it():
    doc = {**mock_deployment(token_ms=5, output_len=80, max_sleep_ms=2),
           "admission": {"max_running": 1, "tick_ms": 2, "max_concurrent_per_tenant": 0}}
    with running_gateway(doc) as srv:
        chat = add_key(srv, "chat")
        nightly = add_key(srv, "nightly", priority="batch")
        seen = _record_engine(srv)
        threads = [_blocker(srv)]
        threads += _post(srv, [("flex", chat, {"service_tier": "flex"}),
                               ("asks-priority", nightly, {"service_tier": "priority"}),
                               ("asks-interactive", nightly, {"priority": "interactive"}),
                               ("plain", chat, {}), ("default", chat, {"service_tier": "default"})])
        for t in threads:
            t.join(20)
        assert seen[0] == "blk"
        # Interactive first (in arrival order); then the batch class, where the flex request and
        # the batch key's requests share turns.
        assert seen[1:3] == ["plain", "default"], seen
        assert sorted(seen[3:]) == ["asks-interactive", "asks-priority", "flex"], seen


def test_bad_service_tier_and_priority_are_400():
    with running_gateway(mock_deployment()) as srv:
        for extra, param in (({"service_tier": "gold"}, "service_tier"), ({"priority": 1}, "priority"),
                             ({"priority": "batch", "service_tier": "priority"}, "priority")):
            status, _, body = srv.chat({"model": "mock", "messages": MSG, **extra})
            assert status == 400 and body["error"]["param"] == param, (extra, body)
        status, _, body = srv.request("POST", "/v1/completions",
                                      {"model": "mock", "prompt": "hi", "max_tokens": 2, "service_tier": "flex"})
        assert status == 200, body


def test_policy_weight_three_gets_three_turns_for_one(tmp_path):
    doc = _two_engines(tmp_path, token_ms=5, output_len=80, max_sleep_ms=2)
    with running_gateway(doc) as srv:
        heavy, light = add_key(srv, "heavy"), add_key(srv, "light")
        seen = _record_engine(srv, "small")
        threads = [_blocker(srv, "small")]
        # Light queues first, then heavy: weights, not arrival, decide the shares.
        threads += _post(srv, [(f"l{i}", light, {}) for i in range(6)] + [(f"h{i}", heavy, {}) for i in range(9)],
                         model="small", gap=0.008)
        for t in threads:
            t.join(30)
        order = seen[1:]
        assert sorted(order) == sorted([f"l{i}" for i in range(6)] + [f"h{i}" for i in range(9)])
        first8 = order[:8]
        # Equal request sizes: heavy's tags advance a third as fast, so it gets 6 of the first 8.
        assert sum(r.startswith("h") for r in first8) == 6, order


def test_context_limit_trims_the_oldest_turns_and_reports_them(tmp_path):
    doc = _two_engines(tmp_path)
    records = []
    with running_gateway(doc, usage_sink=records.append) as srv:
        short, strict = add_key(srv, "short"), add_key(srv, "strict")
        long_turn = " ".join(["word"] * 40)
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": long_turn}, {"role": "assistant", "content": long_turn},
                    {"role": "user", "content": "And now?"}]
        prompts = []
        eng = srv.engine("small").engine
        original = eng.add_request

        def add_request(request_id, prompt_ids, *args, **kwargs):
            prompts.append(list(prompt_ids))
            return original(request_id, prompt_ids, *args, **kwargs)

        eng.add_request = add_request
        status, headers, body = srv.chat({"model": "small", "messages": messages, "max_tokens": 2},
                                         {"Authorization": f"Bearer {short}"})
        assert status == 200, body
        dropped = int(headers["x-tokenyard-context-dropped-tokens"])
        assert dropped > 60 and body["usage"]["prompt_tokens"] <= 60
        assert len(prompts[-1]) == body["usage"]["prompt_tokens"]
        tok = srv.gateway.handles["small"].tokenizer
        assert "Be brief." in tok.decode(prompts[-1]) and "And now?" in tok.decode(prompts[-1])
        deadline = time.monotonic() + 5
        while not any(r.context_dropped_tokens for r in records) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.context_dropped_tokens for r in records if r.context_dropped_tokens] == [dropped]

        # A short prompt is untouched (no header); trim none and a text prompt are 400s.
        status, headers, _ = srv.chat({"model": "small", "messages": MSG, "max_tokens": 2},
                                      {"Authorization": f"Bearer {short}"})
        assert status == 200 and "x-tokenyard-context-dropped-tokens" not in headers
        status, _, body = srv.chat({"model": "small", "messages": messages, "max_tokens": 2},
                                   {"Authorization": f"Bearer {strict}"})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "60" in body["error"]["message"] and body["error"]["param"] == "messages"
        status, _, raw = srv.request("POST", "/v1/completions", {"model": "small", "prompt": long_turn, "max_tokens": 2},
                                     {"Authorization": f"Bearer {short}"})
        assert status == 400 and b"context_length_exceeded" in raw
        # The system message and the latest turn alone over the limit: 400, nothing half-trimmed.
        status, _, body = srv.chat({"model": "small", "max_tokens": 2, "messages": [
            {"role": "system", "content": long_turn}, {"role": "user", "content": long_turn}]},
            {"Authorization": f"Bearer {short}"})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
