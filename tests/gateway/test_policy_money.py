"""Money is exact: integer micro-units, decimal prices converted exactly, one documented rounding."""
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenyard.policies import estimate_cost, format_money, load_policy, parse_money
from tokenyard.policies.schema import Prices

PRICES = {"s": Prices(input=50_000, cached_input=10_000, output=200_000),
          "odd": Prices(input=333_333, cached_input=1, output=999_999)}


def test_decimal_prices_convert_exactly():
    assert parse_money("0.05") == 50_000
    assert parse_money("0.1") + parse_money("0.2") == parse_money("0.3")      # no float drift
    assert parse_money("12") == 12_000_000 and parse_money("0.000001") == 1
    assert parse_money("1.500000") == 1_500_000 and parse_money("2.5e-3") == 2_500
    assert parse_money("123456789012.123456") == 123_456_789_012_123_456
    for bad in ("0.0000001", "1e-7", "-1", "nan", "inf", "abc", ""):
        with pytest.raises(ValueError):
            parse_money(bad)


def test_yaml_number_is_read_from_source_text_not_through_a_float():
    # 0.1 + 0.2 as floats is 0.30000000000000004; here every price must be exact
    doc = """version: 1
engines: {small: a, large: b}
prices:
  a: {input: 0.1, cached_input: "0.2", output: 0.3}
  b: {input: 123456789.123457, cached_input: 0, output: 1}
"""
    p = load_policy(doc)
    assert p.prices["a"] == Prices(100_000, 200_000, 300_000)
    assert p.prices["b"].input == 123_456_789_123_457          # 15 significant digits, exact
    for price in (p.prices["a"].input, p.prices["b"].input):
        assert type(price) is int


def test_rounding_is_half_up_once_per_request():
    # exact cost = tokens * price / 1e6; 10 tokens at 50_000 = 0.5 micro-units -> 1 (half up)
    assert estimate_cost({"x": Prices(50_000, 0, 0)}, "x", 10, 0, 0) == 1
    assert estimate_cost({"x": Prices(49_999, 0, 0)}, "x", 10, 0, 0) == 0
    assert estimate_cost({"x": Prices(150_000, 0, 0)}, "x", 10, 0, 0) == 2        # 1.5 -> 2
    # rounded once over the whole request, not per kind: 0.4 + 0.4 = 0.8 -> 1 (per kind would give 0)
    assert estimate_cost({"x": Prices(40_000, 0, 40_000)}, "x", 10, 0, 10) == 1
    with pytest.raises(ValueError):
        estimate_cost(PRICES, "s", 5, 6, 0)
    with pytest.raises(KeyError):
        estimate_cost(PRICES, "nope", 1, 0, 0)


def test_agrees_with_the_gateway_price_rule():
    from tokenyard.gateway.config.deployment import Prices as GatewayPrices
    g = GatewayPrices(input=333_333, cached_input=1, output=999_999)
    for p, c, o in [(0, 0, 0), (1, 0, 1), (1000, 17, 999), (123_456, 100_000, 7)]:
        assert estimate_cost(PRICES, "odd", p, c, o) == g.cost(p, c, o)


tokens = st.integers(0, 2_000_000)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(tokens, tokens, tokens), max_size=40),
       st.builds(Prices, st.integers(0, 10**9), st.integers(0, 10**9), st.integers(0, 10**9)))
def test_costs_are_integers_and_sums_exact(requests, price):
    prices = {"e": price}
    total = 0
    exact_total = Fraction(0)
    for p, c, o in requests:
        c = min(c, p)
        cost = estimate_cost(prices, "e", p, c, o)
        assert type(cost) is int and cost >= 0
        exact = Fraction((p - c) * price.input + c * price.cached_input + o * price.output, 1_000_000)
        assert abs(cost - exact) <= Fraction(1, 2) and (cost - exact != Fraction(-1, 2))   # half up
        total += cost
        exact_total += exact
    assert type(total) is int
    assert abs(total - exact_total) <= Fraction(len(requests), 2)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**15))
def test_format_and_parse_round_trip(micros):
    text = format_money(micros)
    assert parse_money(text) == micros
    assert Decimal(text) * 1_000_000 == micros
