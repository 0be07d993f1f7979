"""The start-up bench's reading of "the first request after ready no slower than the tenth": each
request position against the rest of its start, and the first-over-tenth ratio with an interval."""
from __future__ import annotations

import math

import pytest

from tokenyard.bench.startup_bench import geomean_ci, position_ratios


def test_a_slow_first_request_stands_out_from_the_other_positions():
    starts = [[0.12] + [0.10 + 0.001 * ((i * 7 + s) % 5) for i in range(9)] for s in range(6)]
    ratios = position_ratios(starts)
    assert len(ratios) == 10
    assert ratios[0] > 1.15                                  # the first is 20 % over the rest
    assert all(0.95 < r < 1.05 for r in ratios[1:]), ratios  # the others sit at 1.0


def test_equal_requests_give_ratios_of_one():
    starts = [[0.1] * 10 for _ in range(4)]
    assert position_ratios(starts) == pytest.approx([1.0] * 10)


def test_geomean_interval_holds_the_mean_and_narrows_with_agreeing_starts():
    mean, lo, hi = geomean_ci([1.0, 1.1, 0.9, 1.05, 0.95, 1.0])
    assert lo <= mean <= hi
    assert mean == pytest.approx(math.exp(sum(map(math.log, [1.0, 1.1, 0.9, 1.05, 0.95, 1.0])) / 6))
    tight = geomean_ci([1.2] * 8)
    assert tight == pytest.approx((1.2, 1.2, 1.2))
    # the same seed gives the same interval
    assert geomean_ci([1.0, 1.3, 0.8], seed=3) == geomean_ci([1.0, 1.3, 0.8], seed=3)


def test_control_tells_a_first_request_cost_from_a_rest_cost() -> None:
    from tokenyard.bench.startup_bench import CONTROL_AT, control_figures
    # A rest costs every request after it 20%; the first pays nothing more: first / sixth 1, sixth / tenth 1.2.
    rest = [[1.2 if i in (0, CONTROL_AT) else 1.0 for i in range(10)] for _ in range(5)]
    got = control_figures(rest)
    assert got["first_over_control_geomean"] == pytest.approx(1.0)
    assert got["control_over_tenth_geomean"] == pytest.approx(1.2)
    # The first pays 30% of its own, the sixth nothing: first / sixth 1.3, sixth / tenth 1.
    first = [[1.3 if i == 0 else 1.0 for i in range(10)] for _ in range(5)]
    got = control_figures(first)
    assert got["first_over_control_geomean"] == pytest.approx(1.3)
    assert got["first_over_control_ci95"] == pytest.approx([1.3, 1.3])
    assert got["control_over_tenth_geomean"] == pytest.approx(1.0)
    # Starts with fewer than 10 requests are left out.
    assert control_figures(first + [[2.0, 1.0]])["first_over_control_geomean"] == pytest.approx(1.3)
