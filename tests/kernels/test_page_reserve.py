"""Huge pages faulted in ahead of need (tokenyard/kernels/page_reserve.py): the size hint a build leaves,
the reservation the next start makes from it, and the arena that takes it or maps its own."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tokenyard.kernels import hugepage_arena, page_reserve
from tokenyard.kernels.hugepage_arena import HUGE_PAGE, HugePageArena

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="huge pages are a Linux matter")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has reserved nothing yet, its weight cache in tmp_path."""
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENYARD_WEIGHT_CACHE", raising=False)
    monkeypatch.delenv("TOKENYARD_HUGE_PAGES", raising=False)
    for name, value in (("_pending", None), ("_hint_path", None), ("_asked", 0)):
        monkeypatch.setattr(page_reserve, name, value)
    yield tmp_path
    page_reserve.release()


def _new_process(monkeypatch) -> None:
    page_reserve.release()
    monkeypatch.setattr(page_reserve, "_hint_path", None)
    monkeypatch.setattr(page_reserve, "_asked", 0)


def test_a_first_start_reserves_nothing_and_its_arena_leaves_the_hint(fresh, monkeypatch):
    key = page_reserve.hint_key("torch", fresh / "model.gguf", {"kv_cache_memory": 1 << 20})
    assert page_reserve.start(key) is False
    assert page_reserve.take(3 * HUGE_PAGE) is None          # nothing reserved: the arena maps its own
    hint = json.loads((fresh / f"arena-{key}.json").read_text())
    assert hint == {"bytes": 3 * HUGE_PAGE}


def test_the_next_start_hands_its_reservation_to_the_arena(fresh, monkeypatch):
    key = page_reserve.hint_key("torch", "m", {})
    page_reserve.start(key)
    weights = [torch.arange(1000, dtype=torch.float32), torch.full((300, 7), 3, dtype=torch.int8)]
    first = HugePageArena.holding(weights)                   # leaves the hint of its size
    _new_process(monkeypatch)
    assert page_reserve.start(key) is True
    taken = []
    real_take = page_reserve.take
    monkeypatch.setattr(hugepage_arena.page_reserve, "take", lambda n: taken.append(r := real_take(n)) or r)
    second = HugePageArena.holding(weights)
    assert taken and taken[0] is not None, "the arena mapped its own memory instead of the reservation"
    assert second.capacity == first.capacity
    assert second.huge
    for i, w in enumerate(weights):
        assert torch.equal(second.view(i), w)
        assert second.view(i).data_ptr() % 64 == 0
    assert page_reserve._pending is None                      # taken once, never twice


def test_a_reservation_of_the_wrong_size_is_dropped(fresh, monkeypatch):
    key = page_reserve.hint_key("torch", "m", {})
    (fresh / f"arena-{key}.json").write_text(json.dumps({"bytes": 2 * HUGE_PAGE}))
    assert page_reserve.start(key)
    assert page_reserve.take(8 * HUGE_PAGE) is None            # too small: the arena maps its own
    assert json.loads((fresh / f"arena-{key}.json").read_text()) == {"bytes": 8 * HUGE_PAGE}
    _new_process(monkeypatch)
    (fresh / f"arena-{key}.json").write_text(json.dumps({"bytes": 64 * HUGE_PAGE}))
    assert page_reserve.start(key)
    assert page_reserve.take(4 * HUGE_PAGE) is None            # far larger than asked: a stale hint


def test_an_untaken_reservation_is_released(fresh, monkeypatch):
    key = page_reserve.hint_key("torch", "m", {})
    (fresh / f"arena-{key}.json").write_text(json.dumps({"bytes": 4 * HUGE_PAGE}))
    assert page_reserve.start(key)
    assert page_reserve.start(key) is False                   # one reservation at a time
    reservation = page_reserve._pending
    page_reserve.release()
    assert page_reserve._pending is None
    assert reservation is not None and reservation.map is not None and reservation.map.closed


@pytest.mark.parametrize("hint", ["{not json", json.dumps({"bytes": -5}), json.dumps({"bytes": 1 << 50}),
                                  json.dumps(["bytes"]), json.dumps({"bytes": "many"})])
def test_a_bad_hint_reserves_nothing_and_is_written_again(fresh, hint):
    key = page_reserve.hint_key("torch", "m", {})
    (fresh / f"arena-{key}.json").write_text(hint)
    assert page_reserve.start(key) is False
    assert page_reserve.take(2 * HUGE_PAGE) is None
    assert json.loads((fresh / f"arena-{key}.json").read_text()) == {"bytes": 2 * HUGE_PAGE}


@pytest.mark.parametrize("knob", ["TOKENYARD_HUGE_PAGES", "TOKENYARD_WEIGHT_CACHE"])
def test_off_when_huge_pages_or_the_weight_cache_are_off(fresh, monkeypatch, knob):
    key = page_reserve.hint_key("torch", "m", {})
    (fresh / f"arena-{key}.json").write_text(json.dumps({"bytes": 4 * HUGE_PAGE}))
    monkeypatch.setenv(knob, "off")
    assert page_reserve.start(key) is False
    assert page_reserve._pending is None


def test_the_key_follows_the_model_file_and_the_options(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    a = page_reserve.hint_key("torch", model, {"kv_cache_memory": 1})
    assert a == page_reserve.hint_key("torch", model, {"kv_cache_memory": 1})
    assert a != page_reserve.hint_key("torch", model, {"kv_cache_memory": 2})
    model.write_bytes(b"y" * 11)                               # rewritten: another size and mtime
    assert a != page_reserve.hint_key("torch", model, {"kv_cache_memory": 1})
