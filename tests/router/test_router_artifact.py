"""The router artifact: numpy scorer == scikit-learn, safe JSON, refusal of old or edited files."""
import json
from pathlib import Path

import numpy as np
import pytest

from tokenyard.router_models.runtime import artifact as art_mod
from tokenyard.router_models.runtime.artifact import ArtifactError, load, save
from tokenyard.router_models.runtime.features import DENSE_NAMES, FEATURE_VERSION, FeatureSpec, extract, matrix, prompt_text
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.train import load_labels, predict, train_router

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tokenyard" / "router_models" / "data"
SHIPPED = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"


@pytest.fixture(scope="module")
def trained():
    train = load_labels(DATA / "train.jsonl")
    cal = load_labels(DATA / "calibration.jsonl")
    first = np.arange(len(cal)) < 800            # a part of each keeps the test fast; the
    art, clf = train_router(train.subset(np.arange(len(train)) < 1600), cal.subset(first),  # property is size-free
                            target_large_share=0.3)
    cal = cal.subset(first)
    return art, clf, cal


def test_numpy_scorer_equals_predict_proba(trained):
    art, clf, cal = trained
    scorer = Scorer(art)
    mine = np.array([scorer.score(t, n) for t, n in zip(cal.texts, cal.tokens)])
    theirs = predict(clf, art.spec, cal)
    assert np.max(np.abs(mine - theirs)) < 1e-9
    # Also on text the training never saw: empty, long, odd characters, extreme counts.
    odd = ["", "ÄÖÜ ßçø 😀 ++--**//", "x" * 5000, "1234567890 " * 40, "What is 99999999 + 1?"]
    counts = [0, 40, 3000, 400, 1_000_000]
    X = matrix(odd, counts, art.spec)
    assert np.max(np.abs(np.array([scorer.score(t, n) for t, n in zip(odd, counts)])
                         - clf.predict_proba(X)[:, 1])) < 1e-9


def test_saved_artifact_scores_the_same_after_loading(trained, tmp_path):
    art, clf, cal = trained
    path = tmp_path / "router.json"
    save(art, path)
    loaded = load(path)
    assert loaded.values == art.values and loaded.indices == art.indices and loaded.threshold == art.threshold
    a, b = Scorer(art), Scorer(loaded)
    for t, n in zip(cal.texts[:50], cal.tokens[:50]):
        assert a.score(t, n) == b.score(t, n)
    assert b"pickle" not in path.read_bytes() and json.loads(path.read_text())["format_version"] == 1


def _rewrite(path: Path, edit) -> None:
    body = json.loads(path.read_text())
    edit(body)
    path.write_text(json.dumps(body))


def test_tampered_weights_fail_with_a_checksum_error(tmp_path):
    path = tmp_path / "router.json"
    path.write_text(SHIPPED.read_text())
    _rewrite(path, lambda b: b["model"]["values"].__setitem__(0, b["model"]["values"][0] + 1.0))
    with pytest.raises(ArtifactError, match=r"router\.json: checksum mismatch .* edited or corrupted"):
        load(path)


def test_tampered_threshold_fails(tmp_path):
    path = tmp_path / "router.json"
    path.write_text(SHIPPED.read_text())
    _rewrite(path, lambda b: b["threshold"].__setitem__("value", 0.99))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        load(path)


def test_old_format_version_fails_with_a_clear_error(tmp_path):
    path = tmp_path / "router.json"
    path.write_text(SHIPPED.read_text())

    def old(b):
        b["format_version"] = 0
        b["checksum"] = art_mod.checksum(b)   # a consistent, but old, file
    _rewrite(path, old)
    with pytest.raises(ArtifactError, match=r"format_version 0 is not supported .* retrain"):
        load(path)


def test_feature_spec_this_code_cannot_compute_fails(tmp_path):
    path = tmp_path / "router.json"
    path.write_text(SHIPPED.read_text())

    def new_spec(b):
        b["feature_spec"]["version"] = 99
        b["checksum"] = art_mod.checksum(b)
    _rewrite(path, new_spec)
    with pytest.raises(ArtifactError, match="feature spec: feature spec version 99 is not supported"):
        load(path)

    def other_dense(b):
        b["feature_spec"]["version"] = FEATURE_VERSION
        b["feature_spec"]["dense"] = b["feature_spec"]["dense"][:-1]
        b["checksum"] = art_mod.checksum(b)
    _rewrite(path, other_dense)
    with pytest.raises(ArtifactError, match="dense features"):
        load(path)


def test_not_json_and_wrong_format_fail(tmp_path):
    path = tmp_path / "router.json"
    path.write_bytes(b"\x80\x04\x95pickle")
    with pytest.raises(ArtifactError, match="not UTF-8|not valid JSON"):
        load(path)
    path.write_text('{"format": "something-else"}')
    with pytest.raises(ArtifactError, match="format is 'something-else'"):
        load(path)
    with pytest.raises(ArtifactError, match="cannot read"):
        load(tmp_path / "missing.json")


def test_shipped_artifact_loads_and_matches_its_training_data():
    art = load(SHIPPED)
    assert art.training["source"] == "suite" and art.calibration_prompts >= 2000
    assert 0.0 < art.threshold < 1.0


def test_features_are_stable_and_need_no_engine():
    spec = FeatureSpec(dense_mean=(0.0,) * len(DENSE_NAMES), dense_scale=(1.0,) * len(DENSE_NAMES))
    row = extract("Add 12 and 30.", 9, spec)
    assert row == extract("Add 12 and 30.", 9, spec)
    assert row[0] == pytest.approx(np.log1p(9)) and row[3] == pytest.approx(np.log1p(4))  # tokens, digits
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompt_text(messages) == "Be brief.\nHi"
    # The serving path (scorer, artifact, gateway hook) loads no engine, torch, scikit-learn or scipy.
    heavy = {"tokenyard.engines", "torch", "sklearn", "scipy"}
    for module in ("tokenyard.router_models.runtime.scorer", "tokenyard.gateway.routing.learned_router"):
        tops = {".".join(name.split(".")[:2]) if name.startswith("tokenyard.") else name.split(".")[0]
                for name in _imports_of(module)}
        assert not heavy & tops, module


def _imports_of(module: str) -> list[str]:
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print(chr(10).join(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return out.split()


def test_threshold_override_is_saved_and_checked(tmp_path):
    from tokenyard.router_models.runtime.artifact import with_threshold

    art = load(SHIPPED)
    path = tmp_path / "manual.json"
    save(with_threshold(art, threshold=0.5), path)
    manual = load(path)
    assert (manual.threshold, manual.threshold_method, manual.values) == (0.5, "manual", art.values)
    share = with_threshold(art, target_large_share=0.2)
    assert share.threshold_method == "large_share" and share.threshold < art.threshold  # 20% < 30% large
    with pytest.raises(ValueError, match="exactly one"):
        with_threshold(art)
