"""Precise policy validation errors: line and column, key path, allowed values; all problems at once."""
import textwrap

import pytest

from tokenyard.policies import PolicyError, build_policy, check_policy, load_policy, load_policy_file
from tokenyard.policies.schema import TimeRange

BASE = """\
version: 1
engines:
  small: demo-small
  large: demo-large
prices:
  demo-small: {input: 0.05, cached_input: 0.01, output: 0.2}
  demo-large: {input: 0.25, cached_input: 0.05, output: 1.0}
"""  # 7 lines; anything appended starts on line 8


def only(text: str):
    problems = check_policy(text)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]


def test_base_is_valid():
    p = load_policy(BASE)
    assert p.prices["demo-small"].input == 50_000 and p.prices["demo-large"].output == 1_000_000


def test_unknown_top_level_key_lists_allowed():
    p = only(BASE + "ruless: []\n")
    assert (p.line, p.column, p.path, p.message) == (8, 1, "ruless", "unknown key")
    assert "rules" in p.allowed and "tenants" in p.allowed
    assert "line 8, column 1: ruless: unknown key (allowed: version, description" in str(p)


def test_prompt_tokens_max_not_an_integer():
    doc = BASE + textwrap.dedent("""\
        rules:
          - name: a
            action: {priority: batch}
          - name: b
            action: {priority: batch}
          - name: c
            match:
              prompt_tokens:
                min: 10
                max: lots
            action: {pin: demo-small}
        """)
    p = only(doc)
    assert p.path == "rules[2].match.prompt_tokens.max"
    assert (p.line, p.column) == (17, 14)
    assert "must be an integer" in p.message and "'lots'" in p.message


def test_prompt_tokens_min_above_max():
    doc = BASE + "rules:\n  - name: r\n    match: {prompt_tokens: {min: 100, max: 10}}\n    action: {pin: demo-large}\n"
    p = only(doc)
    assert p.path == "rules[0].match.prompt_tokens.max"
    assert p.line == 10 and "must be >= min (100)" in p.message


def test_bad_priority_lists_allowed_values():
    p = only(BASE + "rules:\n  - name: r\n    action:\n      priority: urgent\n")
    assert p.path == "rules[0].action.priority" and (p.line, p.column) == (11, 17)
    assert p.allowed == ("interactive", "batch")


def test_pin_to_unknown_engine_lists_priced_engines():
    p = only(BASE + "rules:\n  - name: r\n    action: {pin: gpt-9}\n")
    assert p.path == "rules[0].action.pin" and p.line == 10
    assert set(p.allowed) == {"demo-small", "demo-large"}


def test_sub_micro_price_refused_not_rounded():
    doc = BASE.replace("input: 0.05,", "input: 0.0000005,", 1)
    p = only(doc)
    assert p.path == "prices.demo-small.input" and (p.line, p.column) == (6, 23)
    assert "finer than one micro-unit" in p.message


def test_negative_and_non_numeric_prices_both_reported():
    doc = BASE.replace("output: 0.2", "output: -1").replace("cached_input: 0.05", "cached_input: cheap")
    problems = check_policy(doc)
    assert [(p.path, p.line) for p in problems] == [("prices.demo-small.output", 6),
                                                    ("prices.demo-large.cached_input", 7)]
    assert ">= 0" in problems[0].message and "decimal amount" in problems[1].message


def test_missing_price_kind_is_required():
    p = only(BASE.replace(", output: 1.0", ""))
    assert p.path == "prices.demo-large.output" and p.message == "missing required key" and p.line == 7


def test_threshold_out_of_range_and_both_router_settings():
    p = only(BASE + "router:\n  threshold: 1.5\n")
    assert p.path == "router.threshold" and "[0.0, 1.0]" in p.message and (p.line, p.column) == (9, 14)
    p = only(BASE + "router:\n  threshold: 0.4\n  target_large_share: 0.3\n")
    assert p.path == "router.target_large_share" and "not both" in p.message and p.line == 10


def test_bad_time_range():
    p = only(BASE + 'rules:\n  - name: r\n    match: {time_utc: ["09:00-17:00", "25:00-06:00"]}\n'
                    '    action: {pin: demo-small}\n')
    assert p.path == "rules[0].match.time_utc[1]" and p.line == 10 and p.column == 39
    assert "HH:MM-HH:MM" in p.message
    p = only(BASE + 'rules:\n  - name: r\n    match: {time_utc: "10:00-10:00"}\n    action: {pin: demo-small}\n')
    assert p.path == "rules[0].match.time_utc" and "empty time range" in p.message


def test_budget_at_limit_and_unknown_rate_class():
    doc = BASE + textwrap.dedent("""\
        rate_classes:
          standard: {requests_per_min: 60, tokens_per_min: 1000}
        tenants:
          acme:
            rate_class: gold
            budget: {per_day: 5, at_limit: explode}
        """)
    problems = check_policy(doc)
    assert [(p.path, p.line, p.allowed) for p in problems] == [
        ("tenants.acme.rate_class", 12, ("standard",)),
        ("tenants.acme.budget.at_limit", 13, ("deny", "downgrade")),
    ]


def test_duplicate_keys_and_duplicate_rule_names():
    p = only(BASE + "overflow:\n  shed: true\n  shed: false\n")
    assert p.path == "overflow.shed" and p.message == "duplicate key" and p.line == 10
    p = only(BASE + "rules:\n  - {name: r, action: {pin: demo-small}}\n  - {name: r, action: {pin: demo-large}}\n")
    assert p.path == "rules[1].name" and "also rules[0]" in p.message and p.line == 10


def test_rule_routes_one_way():
    p = only(BASE + "rules:\n  - name: r\n    action: {pin: demo-small, deny: 'go away'}\n")
    assert p.path == "rules[0].action.deny" and "only one of pin, router, deny" in p.message


def test_unknown_rule_key_and_empty_action():
    problems = check_policy(BASE + "rules:\n  - name: r\n    when: {}\n    action: {}\n")
    assert [(p.path, p.line) for p in problems] == [("rules[0].when", 10), ("rules[0].action", 11)]
    assert problems[0].allowed == ("name", "match", "action")
    assert "pin" in problems[1].allowed


def test_yaml_syntax_error_has_position():
    p = only(BASE + "rules: [\n  {name: r\n")
    assert p.path == "" and p.message.startswith("YAML syntax error") and p.line is not None


def test_wrong_types_and_missing_required_top_keys():
    problems = check_policy("version: 2\nrules: {}\n")
    got = [(p.path, p.message) for p in problems]
    assert ("version", "unsupported policy format version 2") in got
    assert ("engines", "missing required key") in got and ("prices", "missing required key") in got
    assert any(path == "rules" and "must be a list" in msg for path, msg in got)


def test_boolean_slip_in_a_tag_value_is_caught():
    p = only(BASE + "rules:\n  - name: r\n    match: {tags: {batch: yes}}\n    action: {priority: batch}\n")
    assert p.path == "rules[0].match.tags.batch" and "quote it" in p.message


def test_engine_roles_must_be_priced_and_distinct():
    p = only(BASE.replace("large: demo-large", "large: demo-small"))
    assert p.path == "engines.large" and "differ" in p.message
    p = only(BASE.replace("small: demo-small", "small: tiny"))
    assert p.path == "engines.small" and set(p.allowed) == {"demo-small", "demo-large"}


def test_policy_error_lists_every_problem():
    bad = BASE + "router: {threshold: 2}\ndefault_priority: soon\nextra: 1\n"
    with pytest.raises(PolicyError) as exc:
        load_policy(bad)
    assert len(exc.value.problems) == 3
    text = str(exc.value)
    assert text.startswith("invalid policy: 3 problems")
    assert "router.threshold" in text and "default_priority" in text and "extra: unknown key" in text
    assert exc.value.to_dict()["problems"][0]["line"] == 8


def test_build_policy_from_data_has_paths_without_positions():
    with pytest.raises(PolicyError) as exc:
        build_policy({"version": 1, "engines": {"small": "a", "large": "b"},
                      "prices": {"a": {"input": "0.1", "cached_input": 0, "output": 1},
                                 "b": {"input": "x", "cached_input": 0, "output": 1}}})
    (p,) = exc.value.problems
    assert p.path == "prices.b.input" and p.line is None


def test_times_are_not_sexagesimal_and_wrap_midnight():
    p = load_policy(BASE + "rules:\n  - name: night\n    match: {time_utc: 22:00-06:00}\n    action: {pin: demo-small}\n")
    (r,) = p.rules[0].match.time_utc
    assert r == TimeRange(22 * 60, 6 * 60) and r.contains(23 * 60) and r.contains(0) and not r.contains(12 * 60)


def test_example_file_is_valid(tmp_path):
    from pathlib import Path
    policy = load_policy_file(Path(__file__).resolve().parents[2] / "tokenyard" / "policies" / "examples" / "default.yaml")
    assert (policy.engines.small, policy.engines.large) == ("demo-small", "demo-large")
    with pytest.raises(PolicyError):
        load_policy_file(tmp_path / "missing.yaml")
