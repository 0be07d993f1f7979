"""Training is deterministic; the shipped router beats random routing on the held-out test split
and its calibrated threshold hits its target share of large calls there.

Everything reads the committed label files (router_models/data/, made by demo/router_labels.py);
no engine runs here.
"""
import json
from pathlib import Path

import numpy as np
import pytest

from router_models.artifact import load
from router_models.calibration import threshold_for_large_share
from router_models.evaluation import evaluate, score_all
from router_models.routing_metrics import at_threshold
from router_models.scorer import Scorer
from router_models.train import hash_split, from_rows, load_labels, read_jsonl, train_router

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "router_models" / "data"
SHIPPED = ROOT / "router_models" / "artifacts" / "demo_router.json"
# Measured APGR on the test split: router 0.819 vs random 0.500 (bench/router_eval.json).
APGR_MARGIN_OVER_RANDOM = 0.15


@pytest.fixture(scope="module")
def splits():
    return {name: load_labels(DATA / f"{name}.jsonl") for name in ("train", "calibration", "test")}


@pytest.fixture(scope="module")
def report(splits):
    rep, _ = evaluate(load(SHIPPED), splits["test"])
    return rep


def test_label_files_have_the_promised_shape(splits):
    for name, data in splits.items():
        cells = {}
        for m in data.meta:
            cells[(m["task"], m["level"])] = cells.get((m["task"], m["level"]), 0) + 1
        assert len(cells) == 32 and max(cells.values()) - min(cells.values()) <= 1, name
        phrasings = {m["phrasing"] for m in data.meta}
        assert (3 in phrasings) == (name != "train"), name   # held-out phrasing never trained on
    assert len(splits["test"]) >= 2000 and len(splits["calibration"]) >= 2000
    train_prompts = set(splits["train"].texts)
    assert not train_prompts & set(splits["test"].texts)


@pytest.fixture(scope="module")
def fresh(splits):
    shipped = load(SHIPPED)
    art, _ = train_router(splits["train"], splits["calibration"], target_large_share=shipped.threshold_target,
                          training=shipped.training)
    return art


def test_training_is_deterministic(splits, fresh):
    again, _ = train_router(splits["train"], splits["calibration"], target_large_share=fresh.threshold_target,
                            training=fresh.training)
    a, b = fresh.to_json(), again.to_json()
    assert a == b and a["checksum"] == b["checksum"]


def test_shipped_artifact_is_what_training_gives(fresh):
    assert fresh.to_json() == load(SHIPPED).to_json()   # the committed file is reproducible bit for bit


def test_router_beats_random_routing_on_the_test_split(report):
    assert report["random"]["apgr"] == pytest.approx(0.5)
    assert report["router"]["apgr"] >= report["random"]["apgr"] + APGR_MARGIN_OVER_RANDOM
    assert report["router"]["cpt_80"] < 0.8 - 0.15   # random needs 80% large calls for 80% of the gap


def test_router_beats_random_at_the_calibrated_share(report):
    cal = report["calibrated"]
    random_quality = report["quality_small"] + cal["large_share"] * (report["quality_large"] - report["quality_small"])
    assert cal["quality"] >= random_quality + 0.03


@pytest.fixture(scope="module")
def scored(splits):
    scorer = Scorer(load(SHIPPED))
    return score_all(scorer, splits["calibration"]), score_all(scorer, splits["test"])


@pytest.mark.parametrize("share", [0.1, 0.2, 0.3, 0.5])
def test_calibration_hits_the_target_share_on_held_out_prompts(splits, scored, share):
    scorer = Scorer(load(SHIPPED))
    cal_scores, test_scores = scored
    assert len(test_scores) >= 2000
    exact = threshold_for_large_share(cal_scores, share)
    from_table = scorer.set_threshold(target_large_share=share)   # what a policy override uses
    for threshold in (exact, from_table):
        got = at_threshold(test_scores, splits["test"].small_correct, splits["test"].large_correct, threshold)
        assert abs(got["large_share"] - share) <= 0.03, (share, got)


def test_shipped_threshold_hits_its_own_target(report):
    assert abs(report["calibrated"]["large_share"] - report["calibrated"]["target"]) <= 0.03


def test_operator_traffic_trains_from_prompt_and_label(tmp_path):
    rows = [json.loads(line) for line in (DATA / "train.jsonl").read_text().splitlines()[:600]]
    traffic = [{"prompt": r["prompt"], "label": r["label"], "prompt_tokens": r["prompt_tokens"]} for r in rows]
    train, cal = hash_split(from_rows(traffic))
    assert 0.15 < len(cal) / len(traffic) < 0.35
    art, _ = train_router(train, cal, target_large_share=0.2)
    assert art.threshold_method == "large_share" and art.calibration_prompts == len(cal)
    with pytest.raises(ValueError, match="row 1 needs prompt, label and prompt_tokens"):
        from_rows([{"prompt": "hi"}])
    assert read_jsonl(DATA / "train.jsonl")[0]["split"] == "train"
