"""Export, canonical hash, diff and versions."""
import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tokenyard.policies import (
    PolicyError,
    PolicyVersion,
    canonical_json,
    diff,
    load_policy,
    next_version,
    policy_hash,
    policy_to_yaml,
    rollback_to,
)
from tokenyard.policies.schema import Prices

EXAMPLE = (Path(__file__).resolve().parents[2] / "tokenyard" / "policies" / "examples" / "default.yaml").read_text()

DOC = """\
# a comment
version: 1
engines: {small: s, large: l}
prices:
  s: {input: 0.05, cached_input: 0.01, output: 0.2}
  l: {input: 0.25, cached_input: 0.05, output: 1.0}
rules:
  - {name: a, match: {tenants: [x]}, action: {pin: l}}
  - {name: b, match: {prompt_tokens: {max: 10}}, action: {priority: batch}}
tenants:
  x: {budget: {per_day: 2}}
"""

SAME_MEANING = """\
prices:   # keys reordered, a different comment, trailing zeros, defaults written out
  l: {output: "1.000000", cached_input: 0.05, input: 0.250}
  s: {output: 0.2, input: 0.05, cached_input: 0.01}
engines:
  large: l
  small: s
version: 1
overflow: {enabled: true, shed: true}
router: {without_score: large}
default_priority: interactive
tenants:
  x:
    budget: {per_day: 2, at_limit: deny}
rules:
  - name: a
    match: {tenants: x}
    action: {pin: l}
  - {name: b, action: {priority: batch}, match: {prompt_tokens: {max: 10}}}
"""


def test_yaml_export_round_trips():
    for text in (DOC, EXAMPLE):
        p = load_policy(text)
        exported = policy_to_yaml(p)
        assert load_policy(exported) == p
        assert policy_to_yaml(load_policy(exported)) == exported       # a fixed point
    assert "input: 0.05\n" in policy_to_yaml(load_policy(DOC))          # money as plain decimals


def test_hash_stable_under_reordering_comments_and_defaults():
    a, b = load_policy(DOC), load_policy(SAME_MEANING)
    assert a == b
    assert canonical_json(a) == canonical_json(b) and policy_hash(a) == policy_hash(b)
    assert len(policy_hash(a)) == 64
    assert '"input":50000' in canonical_json(a)                         # canonical money is micro-units
    cj = canonical_json(a)
    assert cj == json.dumps(json.loads(cj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("old,new", [
    ("output: 0.2}", "output: 0.200001}"),                 # one micro-unit
    ("per_day: 2}", "per_day: 3}"),
    ("tenants: [x]", "tenants: [y]"),
    ("{max: 10}", "{max: 11}"),
    ("priority: batch", "priority: interactive"),
    ("engines: {small: s, large: l}", "engines: {small: l, large: s}"),
    ("version: 1\n", "version: 1\ndescription: hello\n"),
])
def test_hash_changes_with_any_value(old, new):
    assert old in DOC
    assert policy_hash(load_policy(DOC.replace(old, new, 1))) != policy_hash(load_policy(DOC))


def test_hash_changes_with_rule_order():
    p = load_policy(DOC)
    assert policy_hash(replace(p, rules=p.rules[::-1])) != policy_hash(p)


def test_diff_is_a_readable_unified_diff():
    old = load_policy(DOC)
    new = replace(old, prices={**old.prices, "s": Prices(50_000, 10_000, 300_000)})
    text = diff(old, new, "version 1", "version 2")
    lines = text.splitlines()
    assert lines[0] == "--- version 1" and lines[1] == "+++ version 2"
    assert "-    output: 0.2" in lines and "+    output: 0.3" in lines
    assert sum(1 for ln in lines if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))) == 2
    assert diff(old, load_policy(SAME_MEANING)) == ""
    assert diff(None, old).count("\n+") > 10


def test_versions_apply_history_and_rollback():
    t0 = datetime(2025, 1, 1, tzinfo=timezone.utc)
    v1 = next_version(None, DOC, "ops", t0)
    assert (v1.version, v1.author, v1.hash) == (1, "ops", policy_hash(load_policy(DOC)))
    v2_text = DOC.replace("per_day: 2", "per_day: 5")
    v2 = next_version(v1, v2_text, "alice", t0)
    assert v2.version == 2 and "-      per_day: 2" in v2.diff and "+      per_day: 5" in v2.diff
    with pytest.raises(PolicyError):
        next_version(v2, DOC.replace("pin: l", "pin: nope"), "mallory", t0)     # invalid: refused
    v3 = rollback_to([v1, v2], 1, "bob", t0)
    assert v3.version == 3 and v3.hash == v1.hash and v3.document == v1.document
    assert v3.policy() == v1.policy() and v3.note == "rollback to version 1"
    assert PolicyVersion.from_dict(v3.to_dict()) == v3
    with pytest.raises(PolicyError) as exc:
        rollback_to([v1, v2], 9, "bob", t0)
    assert exc.value.problems[0].allowed == ("1", "2")
