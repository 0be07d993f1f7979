"""The rewording benchmark (tokenyard/bench/router_rewording.py): its grammar makes wording the suite's
templates never render, the same for a seed, with the input verbatim; the report has its shape on a
tiny sample; the paired bootstrap gives the intervals it must on constructed cases."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tokenyard.bench import router_rewording as rr
from tokenyard.bench.rewording_grammar import FAMILIES, reword
from tokenyard.demo import task_suite


def _suite_items(n: int = 96) -> list[task_suite.TaskItem]:
    return task_suite.generate_items("test", n, seed=3)


def _all_renderings(task: task_suite.Task, fields: dict[str, str]) -> set[str]:
    return {task.render(fields, p) for p in (*task_suite.ALL_PHRASINGS, *task_suite.ROUTER_TEST_PHRASINGS)}


def test_template_match_recognises_the_suites_own_wording():
    # the absence check below means something only if it finds the templates' wording
    for item in _suite_items(32):
        assert rr.template_match(item.task, item.user_text) == item.phrasing


@pytest.mark.parametrize("family", FAMILIES)
def test_grammar_wording_is_absent_from_the_templates_and_keeps_the_input(family):
    items = _suite_items()
    assert {it.task for it in items} == set(task_suite.TASKS)
    texts = []
    for i, item in enumerate(items):
        task = task_suite.get_task(item.task)
        fields = task.parse(item.user_text, item.phrasing)
        text = reword(item.task, fields, family, random.Random(i), familiar=item.user_text)
        texts.append(text)
        assert rr.template_match(item.task, text) is None, text
        assert text not in _all_renderings(task, fields)
        for name, value in fields.items():
            if name != "kind":
                assert value in text, (name, value, text)
    # a grammar, not one fixed sentence per task: many distinct frames over the sample
    assert len(set(texts)) == len(texts)


def test_grammar_is_deterministic_for_a_seed_and_varies_with_it():
    rows = rr.load_items(rr.LABELS, 60)
    for family in FAMILIES:
        a = [rr.reworded_messages(r, family, seed=7) for r in rows]
        b = [rr.reworded_messages(r, family, seed=7) for r in rows]
        c = [rr.reworded_messages(r, family, seed=8) for r in rows]
        assert a == b
        assert a != c
        # the system message is the item's own
        assert all(m[:-1] == r["messages"][:-1] for m, r in zip(a, rows))


def test_terse_typos_never_touch_the_input():
    fields = {"words": "apple bread chair dog egg"}
    typoed = 0
    for seed in range(200):
        text = reword("reverse", fields, "terse", random.Random(seed))
        assert fields["words"] in text
        typoed += not any(w in text for w in ("backwards", "reverse", "order", "invert", "mirror", "turn around",
                                              "read backwards"))
    assert typoed > 0          # some instructions did get a typo


def test_unknown_family_and_task_are_refused():
    with pytest.raises(ValueError, match="unknown wording family"):
        reword("copy", {"words": "a b"}, "shouting", random.Random(0))
    with pytest.raises(ValueError, match="no rephrasings"):
        reword("juggle", {"words": "a b"}, "question", random.Random(0))
    with pytest.raises(ValueError, match="familiar wording"):
        reword("copy", {"words": "a b"}, "context", random.Random(0))


def test_paired_bootstrap_on_constructed_cases():
    rng = np.random.default_rng(0)
    n = 200
    small = (rng.random(n) < 0.4).astype(float)
    large = np.maximum(small, rng.random(n) < 0.6).astype(float)
    base = rng.random(n)
    scores = {rr.FAMILIAR: base, "same": base.copy(), "flipped": 1.0 - base}
    ci = rr.paired_bootstrap(scores, small, large, threshold=0.5, resamples=200, seed=1)
    assert ci["same"]["agreement"] == [1.0, 1.0]
    assert ci["same"]["apgr_minus_familiar"] == [0.0, 0.0]
    assert ci["flipped"]["agreement"] == [0.0, 0.0]   # 1 - s < 0.5 exactly when s >= 0.5 (no score is 0.5)
    lo, hi = ci[rr.FAMILIAR]["apgr"]
    assert lo <= hi
    # the same seed, the same intervals
    assert rr.paired_bootstrap(scores, small, large, 0.5, 200, 1) == ci


def test_confusion_by_task_counts_flips_each_way():
    tasks = np.array(["copy", "copy", "copy", "sort", "sort"])
    familiar = np.array([True, True, False, False, False])
    new = np.array([False, True, True, False, False])
    needs = np.array([True, False, False, False, True])
    conf = rr.confusion_by_task(tasks, familiar, new, needs)
    assert conf["copy"] == {"items": 3, "agreement": 1 / 3, "to_large": 1, "to_small": 1, "to_small_needing_large": 1}
    assert conf["sort"] == {"items": 2, "agreement": 1.0, "to_large": 0, "to_small": 0, "to_small_needing_large": 0}


def test_report_structure_on_a_tiny_sample():
    report = rr.run(limit=24, resamples=30, seed=0)
    assert report["items"] == 24
    assert report["familiar_token_mismatches"] == 0      # counts as the committed labels (and the gateway) count
    assert list(report["wordings"]) == [rr.FAMILIAR, *FAMILIES]
    fam = report["wordings"][rr.FAMILIAR]
    assert fam["agreement"] == 1.0 and fam["apgr_minus_familiar"] == 0.0
    for name, w in report["wordings"].items():
        assert 0.0 <= w["agreement"] <= 1.0 and 0.0 <= w["large_share"] <= 1.0
        assert 0.0 <= w["cpt_95"] <= 1.0
        assert set(w["ci95"]) == {"apgr", "cpt_95", "large_share", "apgr_minus_familiar", "cpt_95_minus_familiar",
                                  "agreement"}
        for lo, hi in w["ci95"].values():
            assert lo <= hi
        assert abs(w["apgr_minus_familiar"] - (w["apgr"] - fam["apgr"])) < 1e-12
        conf = w["confusion_by_task"]
        assert sum(c["items"] for c in conf.values()) == 24
        # the per-task agreements, weighted by their items, are the overall one (to rounding)
        assert abs(sum(c["agreement"] * c["items"] for c in conf.values()) / 24 - w["agreement"]) < 1e-12
        assert all(c["to_small_needing_large"] <= c["to_small"] for c in conf.values())
        if name != rr.FAMILIAR:
            assert w["template_wordings"] == 0
            assert w["in_train_or_calibration"] == 0
        else:
            assert w["template_wordings"] == 24


def test_cli_prints_without_writing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tokenyard.bench.results_io.RESULTS_DIR", tmp_path)
    assert rr.main(["--limit", "16", "--resamples", "10", "--no-results"]) == 0
    out = capsys.readouterr().out
    assert "16 items" in out and "agreement" in out
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        rr.main(["--limit", "0"])
