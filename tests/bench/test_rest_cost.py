"""The rest-cost bench (tokenyard/bench/rest_cost.py) measures what it says, on tiny settings."""
from __future__ import annotations

import sys

import pytest

from tokenyard.bench import rest_cost


def test_sweep_reports_each_rest_with_its_first_and_fifth_read():
    out = rest_cost.sweep([0, 3], repeats=2)
    assert list(out) == ["0", "3"]
    for row in out.values():
        assert row["first_read_ms"] > 0 and row["fifth_read_ms"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_HUGEPAGE is Linux's")
def test_first_touch_times_each_fresh_process():
    times = rest_cost.first_touch(2)
    assert len(times) == 2 and all(0 < t < 60_000 for t in times)


def test_bad_arguments_are_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["rest_cost", "--repeats", "0", "--no-results"])
    with pytest.raises(SystemExit) as e:
        rest_cost.main()
    assert e.value.code == 2 and "--repeats" in capsys.readouterr().err
