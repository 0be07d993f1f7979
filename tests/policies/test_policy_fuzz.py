"""Validation robustness: any input either loads or raises PolicyError, nothing else."""
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenyard.policies import PolicyError, build_policy, load_policy, policy_hash, policy_to_yaml
from tokenyard.policies.rule_validation import ACTION_KEYS, MATCH_KEYS, RANGE_KEYS, RULE_KEYS
from tokenyard.policies.validation import BUDGET_KEYS, OVERFLOW_KEYS, PRICE_KEYS, RATE_KEYS, ROUTER_KEYS, TENANT_KEYS, TOP_KEYS

EXAMPLE = (Path(__file__).resolve().parents[2] / "tokenyard" / "policies" / "examples" / "default.yaml").read_text()
KEYS = sorted(set(TOP_KEYS + ACTION_KEYS + BUDGET_KEYS + MATCH_KEYS + OVERFLOW_KEYS + PRICE_KEYS + RANGE_KEYS
                  + RATE_KEYS + ROUTER_KEYS + RULE_KEYS + TENANT_KEYS + ("small", "large", "demo-small", "demo-large",
                                                                        "*", "x")))
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["demo-small", "demo-large", "auto", "batch", "interactive", "deny", "downgrade", "0.05",
                     "22:00-06:00", "24:00-01:00", "1e-9", "-0", "", "*", "~", "yes", "1:30"]),
    st.text(max_size=12))
keys = st.one_of(st.sampled_from(KEYS), st.text(max_size=6))
trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                      st.dictionaries(keys, inner, max_size=6)), max_leaves=30)


def loads_or_policy_error(text: str) -> None:
    try:
        p = load_policy(text)
    except PolicyError as exc:
        assert exc.problems and all(isinstance(str(pr), str) for pr in exc.problems)
        return
    assert load_policy(policy_to_yaml(p)) == p         # whatever loads also exports and reloads
    assert len(policy_hash(p)) == 64


@FAST
@given(st.text(max_size=200))
def test_random_text(text):
    loads_or_policy_error(text)


@FAST
@given(st.dictionaries(st.sampled_from(TOP_KEYS), trees, max_size=10))
def test_random_documents_with_schema_keys(doc):
    loads_or_policy_error(yaml.safe_dump(doc, allow_unicode=True))
    try:
        build_policy(doc)
    except PolicyError:
        pass


@FAST
@given(st.data())
def test_mutated_example(data):
    lines = EXAMPLE.splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["drop", "dup", "replace_value", "indent"]))
        if op == "drop":
            del lines[i]
        elif op == "dup":
            lines.insert(i, lines[i])
        elif op == "indent":
            lines[i] = "  " + lines[i]
        elif ":" in lines[i]:
            head = lines[i].split(":", 1)[0]
            lines[i] = f"{head}: {data.draw(scalars)!s}"
        if not lines:
            break
    loads_or_policy_error("\n".join(lines) + "\n")


def test_nasty_yaml_constructs_are_policy_errors():
    for text in ["a: &x [*x]\n", "!!python/object:os.system {}\n", "--- 1\n--- 2\n", "\x00", "[" * 5000,
                 "version: 1\n<<: {engines: 1}\n", "? [1, 2]\n: 3\n", "version: !!binary aGk=\n"]:
        loads_or_policy_error(text)
