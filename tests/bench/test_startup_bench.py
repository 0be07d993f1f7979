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
