"""Policy documents that used to freeze the event loop or end in a 500: YAML aliases ("billion
laughs") expanded during validation, a diff that ran for minutes, 100k nested brackets sent as
JSON, lone surrogates in a document; and /health answering while an admin's document is checked."""
from __future__ import annotations

import json
import threading
import time

import pytest
from gateway_helpers import SHARED_REDIS, delete_prefix, running_gateway, unique_prefix
from policy_gateway_helpers import BASE_POLICY, bearer, make_keys, put_policy, two_engine_deployment

from tokenyard.policies import PolicyError, load_policy
from tokenyard.policies.line_diff import unified_diff


def laughs(levels: int = 9, width: int = 9) -> str:
    """A small document whose aliases expand to width**levels strings (the \\u escape took the
    admin route's surrogate check through yaml.safe_load + json.dumps, which expanded them)."""
    lines = ['x0: &a0 ["lol\\u0041"]']
    for i in range(1, levels + 1):
        lines.append(f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return BASE_POLICY + "\n".join(lines) + "\nrules:\n  - name: r\n    match: {tenants: *a%d}\n" \
        "    action: {pin: small}\n" % levels


def laughs_in_rules(tenants: int = 2000, copies: int = 3000) -> str:
    """~30 KB: one rule with a long tenant list, then thousands of aliases of it (linear, but
    millions of strings for validation to read)."""
    names = ", ".join(f"t{i}" for i in range(tenants))
    return BASE_POLICY + f"rules:\n  - &r {{name: r0, match: {{tenants: [{names}]}}, action: {{pin: small}}}}\n" \
        + "  - *r\n" * copies


def _timed(fn, *args):
    t0 = time.perf_counter()
    try:
        fn(*args)
        outcome = None
    except PolicyError as e:
        outcome = e
    return time.perf_counter() - t0, outcome


@pytest.mark.parametrize("make", [laughs, laughs_in_rules])
def test_aliases_are_refused_before_any_expansion(make):
    seconds, err = _timed(load_policy, make())
    assert err is not None and any("alias" in p.message for p in err.problems), err
    assert seconds < 0.5, seconds


def test_a_single_alias_is_refused_with_its_line():
    text = BASE_POLICY + "rules:\n  - name: r\n    match: {tenants: &t [acme]}\n    action: {pin: small}\n" \
                         "  - name: s\n    match: {tenants: *t}\n    action: {pin: large}\n"
    with pytest.raises(PolicyError) as e:
        load_policy(text)
    [p] = e.value.problems
    assert "alias" in p.message and p.line == text.splitlines().index("    match: {tenants: *t}") + 1


def test_lone_surrogate_in_a_document_is_a_problem():
    with pytest.raises(PolicyError) as e:
        load_policy(BASE_POLICY.replace("test policy", '"bad \\ud800 text"'))
    assert any("surrogate" in p.message and p.path == "description" for p in e.value.problems)


def _apply(before: list[str], diff: str) -> list[str]:
    """Apply a unified diff (what patch does), checking every context and removed line."""
    import re
    out, pos, lines, k = [], 0, diff.splitlines(keepends=True)[2:], 0
    while k < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[k])
        assert m, lines[k]
        start = int(m.group(1)) - (1 if m.group(2) != "0" else 0)
        out += before[pos:start]
        pos = start
        k += 1
        while k < len(lines) and not lines[k].startswith("@@"):
            tag, line = lines[k][0], lines[k][1:]
            if tag in " -":
                assert before[pos] == line, (pos, before[pos], line)
                pos += 1
            if tag in " +":
                out.append(line)
            k += 1
    return out + before[pos:]


def test_line_diff_is_bounded_and_still_a_diff():
    # One side long, the other short and made of the same few lines: SequenceMatcher's worst case
    # (no "popular line" junking under 200 lines), minutes on a 17 KB document before.
    before = ["x\n" if i % 2 else "y\n" for i in range(40_000)]
    after = ["y\n" if i % 3 else "x\n" for i in range(199)]
    t0 = time.perf_counter()
    out = unified_diff(before, after, "old", "new")
    assert time.perf_counter() - t0 < 1.0
    assert out.startswith("--- old\n+++ new\n@@ -1,40000 +1,199 @@\n")
    assert _apply(before, out) == after
    # Small differences keep a minimal diff with context.
    a = [f"line {i}\n" for i in range(1000)]
    b = a[:500] + ["new\n"] + a[501:]
    assert unified_diff(a, b, "a", "b") == "--- a\n+++ b\n@@ -498,7 +498,7 @@\n line 497\n line 498\n line 499\n" \
                                          "-line 500\n+new\n line 501\n line 502\n line 503\n"
    assert unified_diff(a, a, "a", "b") == ""


@pytest.mark.parametrize("max_pairs", [0, 250_000])
def test_line_diff_applies_back(max_pairs):
    import random
    rng = random.Random(3)
    for _ in range(300):
        a = [f"{rng.randrange(6)}\n" for _ in range(rng.randrange(40))]
        b = [f"{rng.randrange(6)}\n" for _ in range(rng.randrange(40))]
        out = unified_diff(a, b, "a", "b", max_pairs=max_pairs)
        assert _apply(a, out) == b and (out == "") == (a == b), (a, b, out)


@pytest.fixture(scope="module")
def world():
    prefix = unique_prefix("edgepol")
    keys = make_keys(prefix, "acme")
    try:
        with running_gateway(two_engine_deployment(prefix, limits={"max_body_bytes": 1 << 20})) as srv:
            assert put_policy(srv, keys["admin"], BASE_POLICY)[0] == 200
            yield srv, keys
    finally:
        delete_prefix(SHARED_REDIS, prefix)


def _health_while(srv, fn) -> tuple[float, object]:
    """Run fn in a thread; meanwhile the slowest /health answer (seconds)."""
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.perf_counter()
        assert srv.request("GET", "/health", headers={"Authorization": ""})[0] == 200
        slowest = max(slowest, time.perf_counter() - t0)
        time.sleep(0.01)
    worker.join()
    return slowest, result[0]


@pytest.mark.parametrize("path", ["/admin/policy/validate", "/admin/policy"])
def test_billion_laughs_over_http_is_refused_quickly(world, path):
    srv, keys = world
    slowest, (status, body) = _health_while(srv, lambda: srv.request(
        "POST" if path.endswith("validate") else "PUT", path, laughs(),
        {**bearer(keys["admin"]), "Content-Type": "application/yaml"})[::2])
    assert slowest < 0.5
    if path.endswith("validate"):
        assert status == 200 and json.loads(body)["valid"] is False
    else:
        assert status == 422 and json.loads(body)["error"]["code"] == "invalid_policy"


def test_big_document_diff_keeps_health_responsive(world):
    srv, keys = world
    tenants = ", ".join(f"t{(i * 7919) % 997}" for i in range(30_000))   # ~180 KB: seconds of validation
    text = BASE_POLICY + f"rules:\n  - name: big\n    match: {{tenants: [{tenants}]}}\n    action: {{pin: small}}\n"
    slowest, (status, body) = _health_while(srv, lambda: srv.request(
        "POST", "/admin/policy/validate", text, {**bearer(keys["admin"]), "Content-Type": "application/yaml"})[::2])
    assert status == 200, body[:300]
    assert json.loads(body)["valid"] is True and json.loads(body)["diff"]
    assert slowest < 0.5


@pytest.mark.parametrize("body", ["[" * 100_000, '{"version": ' + "9" * 5000 + "}", '{"a": "\\ud800"}'])
@pytest.mark.parametrize("path", ["/admin/policy/validate", "/admin/policy"])
def test_json_bodies_that_broke_the_parser(world, path, body):
    srv, keys = world
    status, _, data = srv.request("POST" if path.endswith("validate") else "PUT", path, body,
                                  {**bearer(keys["admin"]), "Content-Type": "application/json"})
    assert status in (400, 422) or (status == 200 and json.loads(data)["valid"] is False), (status, data[:300])
    if status != 200:
        assert set(json.loads(data)["error"]) >= {"message", "type", "param", "code"}


def test_json_surrogate_pairs_are_read_as_json_reads_them(world):
    """json.dumps writes an emoji as a \\ud83d\\ude00 pair, which YAML would read as two lone
    surrogates (and a reply with them could not be encoded: a 500 under schemathesis)."""
    import yaml
    srv, keys = world
    data = yaml.safe_load(BASE_POLICY)
    data["description"] = "smile \U0001F600"
    data["rules"] = [{"name": "r", "match": {"tags": {"k\U0001F600": ["v"]}}, "action": {"pin": "small"}}]
    status, _, body = srv.request("POST", "/admin/policy/validate", json.dumps(data),
                                  {**bearer(keys["admin"]), "Content-Type": "application/json"})
    assert status == 200, body[:300]
    assert isinstance(json.loads(body)["valid"], bool)
    data["rules"] = []
    status, _, body = srv.request("POST", "/admin/policy/validate", json.dumps(data),
                                  {**bearer(keys["admin"]), "Content-Type": "application/json"})
    assert status == 200 and json.loads(body)["valid"] is True, body[:300]
