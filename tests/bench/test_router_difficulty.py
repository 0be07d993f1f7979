"""The difficulty bench's helpers (tokenyard/bench/router_difficulty.py): carries, the features a
router told the task would read, and the paired bootstrap. No training here: the runs are the benchmark."""
from __future__ import annotations

import numpy as np
import pytest

from tokenyard.bench import router_difficulty as rd


@pytest.mark.parametrize("a, b, carries", [(0, 0, 0), (5, 5, 1), (95, 5, 2), (999, 1, 3), (123, 456, 0), (19, 1, 1)])
def test_carries_are_counted_as_written_addition_makes_them(a, b, carries):
    assert rd._carries(a, b) == carries


def _row(task, text, phrasing=0, level=1, system=""):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return {"task": task, "phrasing": phrasing, "level": level, "messages": msgs}


def test_told_features_read_the_true_task_and_the_parsed_input():
    f = rd.told_features(_row("count", "Count the letter b in: a b b c", system="Be brief."),
                         ("level", "system", "payload"))
    assert f["t=count"] == 1 and f["level=count1"] == 1 and f["system=count|Be brief."] == 1
    assert f["count:answer"] == 2 and f["count:n"] == 4 and f["count:answer=2"] == 1
    assert not any(k.startswith("count:") for k in rd.told_features(
        _row("count", "Count the letter b in: a b b c"), ("level", "payload", "no_count")))
    g = rd.told_features(_row("combo", "What is 95 + 5? Write the answer two times."), ("payload",))
    assert g["t=add_twice"] == 1 and g["add_twice:carries"] == 2 and g["add_twice:digits"] == 2
    # only the parts asked for
    assert set(rd.told_features(_row("sort", "Sort these numbers from smallest to largest: 3 1"), ())) == {"t=sort"}


def test_paired_bootstrap_of_a_router_against_itself_is_zero():
    rng = np.random.default_rng(1)
    small, large = rng.random(300) < 0.4, rng.random(300) < 0.6
    scores = rng.random(300)
    ci = rd.bootstrap(scores, small.astype(float), large.astype(float), 50, 0, baseline=scores)
    assert ci["apgr_minus_base"] == [0.0, 0.0] and ci["cpt_95_minus_base"] == [0.0, 0.0]
    assert ci["apgr"][0] <= ci["apgr"][1]
    assert ci == rd.bootstrap(scores, small.astype(float), large.astype(float), 50, 0, baseline=scores)
