"""The feature-trial bench's helpers (tokenyard/bench/router_feature_trials.py): the intent hashing,
the WordNet synonym map on a hand-made synset list and data file, and the patch that must restore
the feature functions. No training here: the trials themselves are the benchmark."""
from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.bench import router_feature_trials as ft
from tokenyard.router_models.runtime import features as F


def test_task_key_splits_combo_by_kind():
    assert ft.task_key({"task": "sort", "answer": "1 2"}) == "sort"
    assert ft.task_key({"task": "combo", "answer": "12 12"}) == "add_twice"
    assert ft.task_key({"task": "combo", "answer": "CUP DOG"}) == "reverse_upper"


def test_intent_columns_are_stable_and_read_the_payload_kind():
    a = ft.intent_columns("revers order word : cup dog", dim=1 << 10)
    assert a == ft.intent_columns("revers order word : cup dog", dim=1 << 10)
    assert all(0 <= c < 1 << 10 for c in a)
    # same words, numbers instead of words as the payload: only the kind column differs
    b = ft.intent_columns("revers order word : 1 2", dim=1 << 10)
    assert a[:-1] == b[:-1] and a[-1] != b[-1]
    # a name is masked: two names give the same columns
    assert ft.intent_columns("Kusunu liv", 1 << 10) == ft.intent_columns("Babaki liv", 1 << 10)
    X = ft.intent_matrix(["revers order word : cup dog", ""], dim=1 << 10)
    norms = (X.multiply(X).sum(axis=1)).A1
    assert norms[0] == pytest.approx(1.0, abs=1e-12) and norms[1] == pytest.approx(1.0, abs=1e-12)


def test_synonym_map_maps_unseen_words_to_the_most_shared_training_word():
    train = ["Reverse the order of these words: cup dog"] * 30 + ["Sort these numbers: 3 1"] * 30
    synsets = [["invert", "reverse"], ["invert", "turn_back", "reverse"], ["invert", "sort"],
               ["kind", "sort"], ["reverse", "order"]]
    smap = ft.synonym_map(train, iter(synsets))
    assert smap["invert"] == "revers"           # two synsets with reverse, one with sort
    assert smap["kind"] == "sort"
    assert "revers" not in smap and "order" not in smap     # training words are never keys
    assert "turn_back" not in smap and "turn" not in smap   # two content words: no single key
    # below the frequency floor nothing is a target
    assert ft.synonym_map(train[:5], iter(synsets)) == {}
    # purity: "order" is used by one task only, "revers" too; a word shared by two tasks is dropped
    mixed = ["Reverse the order of these words: cup dog"] * 30 + ["Put in order: 3 1"] * 30
    keys = ["reverse"] * 30 + ["sort"] * 30
    pure = ft.synonym_map(mixed, iter([["arrange", "order"], ["invert", "reverse"]]), keys=keys, purity=0.9)
    assert pure == {"invert": "revers"}


def test_wordnet_data_file_parsing(tmp_path: Path):
    header = "  1 This software and database is being provided to you\n"
    (tmp_path / "data.verb").write_text(header + "00001 30 v 03 invert 0 reverse 0 turn_back 0 000 | gloss\n")
    (tmp_path / "data.noun").write_text(header + "00002 05 n 02 Capital(a) 0 upper_case 0 000 | gloss\n")
    got = list(ft.wordnet_synsets(tmp_path, ("verb", "noun")))
    assert got == [["invert", "reverse", "turn_back"], ["capital", "upper_case"]]


def test_patched_restores_the_feature_functions():
    before = F.canonical
    with pytest.raises(RuntimeError):
        with ft.patched(canonical=lambda w: "x"):
            assert F.canonical("anything") == "x"
            raise RuntimeError("boom")
    assert F.canonical is before
