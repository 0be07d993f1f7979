"""The N-engine router (tokenyard/router_models/runtime/engine_set.py, selection.py, training/train_engines.py,
engine_curves.py): selection rules, numpy scorer == scikit-learn per engine, the version-2 artifact
and its refusals, version-1 artifacts unchanged, labels joined by id, curves on a cost axis."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenyard.router_models.runtime.artifact import Artifact, ArtifactError
from tokenyard.router_models.runtime.artifact import load as load_v1
from tokenyard.router_models.runtime.engine_set import EngineScorer, load_router, save
from tokenyard.router_models.runtime.selection import (
    best_under_cost_cap,
    cheapest_good_enough,
    choose_all,
    cost_table,
    lam_for_cost_cap,
)
from tokenyard.router_models.training.engine_curves import cost_cap_curve, evaluate_engines, random_curve
from tokenyard.router_models.training.routing_metrics import apgr, routing_curve
from tokenyard.router_models.training.train_engines import EngineLabels, engine_labels, probabilities, train_engine_set

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"
SHIPPED_V1 = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"
COST = np.array([1.0, 2.0, 5.0])


def test_cheapest_engine_reaching_the_target_else_the_best_guess():
    p = np.array([0.3, 0.7, 0.9])
    assert cheapest_good_enough(p, COST, 0.2) == 0
    assert cheapest_good_enough(p, COST, 0.5) == 1
    assert cheapest_good_enough(p, COST, 0.8) == 2
    assert cheapest_good_enough(np.array([0.3, 0.6, 0.5]), COST, 0.95) == 1     # none reaches it: highest P
    assert cheapest_good_enough(np.array([0.6, 0.6, 0.5]), COST, 0.95) == 0     # a tie goes to the cheaper
    with pytest.raises(ValueError):
        cheapest_good_enough(p, COST, 1.5)


def test_cost_cap_trades_quality_for_cost_at_one_rate():
    p = np.array([0.3, 0.7, 0.9])
    assert best_under_cost_cap(p, COST, 0.0) == 2          # free: the best
    assert best_under_cost_cap(p, COST, 0.1) == 1          # 0.7 - 0.2 > 0.9 - 0.5 and > 0.3 - 0.1
    assert best_under_cost_cap(p, COST, 1.0) == 0
    # two engines, costs 1 and 5: large exactly when P(large) - P(small) > 4 lam
    assert best_under_cost_cap(np.array([0.5, 0.9]), COST[[0, 2]], 0.099) == 1
    assert best_under_cost_cap(np.array([0.5, 0.9]), COST[[0, 2]], 0.101) == 0


def test_vectorised_choices_equal_the_one_prompt_rules():
    rng = np.random.default_rng(3)
    P = rng.random((400, 3))
    P[:40, 1] = P[:40, 0]                                       # ties
    for t in (0.0, 0.35, 0.8, 1.0):
        assert choose_all(P, COST, quality_target=t).tolist() == [cheapest_good_enough(r, COST, t) for r in P]
    for lam in (0.0, 0.02, 0.1, 0.5):
        assert choose_all(P, COST, lam=lam).tolist() == [best_under_cost_cap(r, COST, lam) for r in P]


def test_cost_table_is_monotone_and_the_cap_picks_the_most_quality_within_it():
    rng = np.random.default_rng(4)
    P = rng.random((300, 3))
    table = cost_table(P, COST)
    lams, costs = [r[0] for r in table], [r[1] for r in table]
    assert lams == sorted(lams) and costs == sorted(costs, reverse=True)
    assert costs[0] <= 5.0 and costs[-1] == pytest.approx(1.0)
    for cap in (1.0, 1.7, 2.5, 4.0):
        lam = lam_for_cost_cap(table, cap)
        assert COST[choose_all(P, COST, lam=lam)].mean() <= cap + 1e-9


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """The pair's labels plus a made-up third engine (right on levels 1-2 where the large one is, and
    wherever the small one is), trained on parts of the splits to stay fast."""
    folder = tmp_path_factory.mktemp("engines")
    path = folder / "mid.jsonl"
    with open(path, "w") as f:
        for split in ("train", "calibration", "test"):
            for line in open(DATA / f"{split}.jsonl"):
                r = json.loads(line)
                ok = bool(r["small_correct"] or (r["large_correct"] and r["level"] <= 2))
                f.write(json.dumps({"id": r["id"], "correct": ok}) + "\n")
    data = engine_labels(DATA, {"mid": path})

    def part(d: EngineLabels, n: int) -> EngineLabels:
        return EngineLabels(d.names, d.texts[:n], d.tokens[:n], d.correct[:n], d.meta[:n])
    train, cal, test = part(data["train"], 1200), part(data["calibration"], 600), part(data["test"], 600)
    es, models = train_engine_set(train, cal, {"demo-small": 1, "mid": 2, "demo-large": 5})
    return es, models, cal, test, path


def test_labels_join_by_id_in_cost_order(three):
    es, _, cal, _, _ = three
    assert cal.names == ["demo-small", "demo-large", "mid"]                  # as read
    assert es.names == ["demo-small", "mid", "demo-large"]                   # cheapest first in the artifact
    assert [e.cost for e in es.engines] == [1.0, 2.0, 5.0]
    assert (cal.correct[:, 2] >= cal.correct[:, 0]).all()


def test_numpy_scorer_equals_each_engines_predict_proba_and_survives_a_round_trip(three, tmp_path):
    es, models, cal, _, _ = three
    save(es, tmp_path / "r.json")
    loaded = load_router(tmp_path / "r.json")
    scorer = EngineScorer(loaded)
    # the artifact keeps engines in cost order; the models come back in that order too
    theirs = probabilities(models, es.spec, cal)
    mine = np.array([scorer.probabilities(t, n) for t, n in zip(cal.texts, cal.tokens)])
    assert np.max(np.abs(mine - theirs)) < 1e-9
    odd = ["", "ÄÖÜ 😀 ++--", "x" * 5000]
    assert all(np.all((scorer.probabilities(t, 7) > 0) & (scorer.probabilities(t, 7) < 1)) for t in odd)
    assert loaded.quality_target == es.quality_target and loaded.cost_table == es.cost_table
    assert loaded.quantiles == es.quantiles and len(es.quantiles) == 201


def test_selection_overrides_and_the_default_target(three):
    es, _, _, test, _ = three
    scorer = EngineScorer(es)
    p = scorer.probabilities(test.texts[0], test.tokens[0])
    assert scorer.choose(p) == cheapest_good_enough(p, scorer.costs, es.quality_target)
    assert scorer.choose(p, quality_target=0.0) == 0
    rng = np.random.default_rng(6)
    ps = rng.random((200, 3))
    ps[:20, 2] = ps[:20, 1]
    for t in (0.2, 0.6, 0.99):
        scorer.set_selection(quality_target=t)
        assert [scorer.choose(q) for q in ps] == choose_all(ps, scorer.costs, quality_target=t).tolist()
    for cap in (1.5, 3.0):
        scorer.set_selection(cost_cap=cap)
        assert [scorer.choose(q) for q in ps] == choose_all(ps, scorer.costs, lam=scorer.lam).tolist()
    scorer.set_selection(cost_cap=1.0)                  # a cap at the cheapest engine's cost: always it
    assert scorer.choose(p) == 0
    with pytest.raises(ValueError):
        scorer.set_selection(quality_target=0.5, cost_cap=2.0)


def test_tampered_or_malformed_engine_set_is_refused(three, tmp_path):
    es, _, _, _, _ = three
    path = tmp_path / "r.json"
    save(es, path)
    body = json.loads(path.read_text())
    body["model"]["engines"][1]["intercept"] += 1.0
    path.write_text(json.dumps(body))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        load_router(path)
    from tokenyard.router_models.runtime.artifact import checksum
    body["model"]["engines"][1]["intercept"] -= 1.0
    body["calibration"]["quantiles"] = [0.5, 0.4]
    body["checksum"] = checksum(body)
    path.write_text(json.dumps(body))
    with pytest.raises(ArtifactError, match="quantiles"):
        load_router(path)
    body["calibration"]["quantiles"] = es.quantiles
    body["model"]["engines"].reverse()                  # priciest first: refused even with a valid checksum
    body["checksum"] = checksum(body)
    path.write_text(json.dumps(body))
    with pytest.raises(ArtifactError, match="cheapest engine first"):
        load_router(path)


def test_a_two_engine_artifact_loads_exactly_as_before():
    old = load_router(SHIPPED_V1)
    assert isinstance(old, Artifact) and old == load_v1(SHIPPED_V1)


def test_extra_engine_files_are_checked_with_the_line_number(three, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "train-0", "correct": true}\n{"id": "train-1", "correct": "yes"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        engine_labels(DATA, {"x": bad})
    short = tmp_path / "short.jsonl"
    short.write_text('{"id": "train-0", "correct": true}\n')
    with pytest.raises(ValueError, match="no outcome for"):
        engine_labels(DATA, {"x": short})


def test_two_engine_curves_match_the_threshold_curve_and_random_is_the_line():
    rng = np.random.default_rng(5)
    n = 500
    small = rng.random(n) < 0.4
    large = small | (rng.random(n) < 0.3)
    correct = np.stack([small, large], axis=1)
    P = np.clip(np.stack([small * 0.5 + rng.random(n) * 0.5, large * 0.5 + rng.random(n) * 0.5], axis=1), 0, 1)
    cost = np.array([1.0, 5.0])
    mine = cost_cap_curve(P, correct, cost)
    theirs = routing_curve(P[:, 0] - P[:, 1], small, large)        # sort by expected gain
    # every point of the lam sweep is a point of the threshold sweep (same ordering, same ties)
    pts = set(zip(theirs.share.round(9), theirs.quality.round(9)))
    assert all((round(s, 9), round(q, 9)) in pts for s, q in zip(mine.share, mine.quality))
    assert apgr(random_curve(correct, cost)) == pytest.approx(0.5, abs=1e-12)
    report, _ = evaluate_engines(P, correct, cost, ["s", "l"])
    assert report["oracle"]["apgr"] >= report["cost_cap"]["apgr"] > 0.5


def test_cli_refuses_engine_training_without_a_cost_for_every_engine(three, tmp_path, capsys):
    from tokenyard.router_models.training.cli import main

    *_, path = three
    out = tmp_path / "r.json"
    assert main(["train", "--engine", f"mid={path}", "--cost", "demo-small=1", "--cost", "mid=2",
                 "--out", str(out)]) == 2
    assert "--cost missing for demo-large" in capsys.readouterr().err and not out.exists()
    assert main(["train", "--engine", "mid", "--out", str(out)]) == 2
    assert "--engine expects NAME=VALUE" in capsys.readouterr().err
    assert main(["train", "--engine", f"mid={path}", "--target-large-share", "0.3", "--out", str(out)]) == 2
    assert "two-engine setting" in capsys.readouterr().err
