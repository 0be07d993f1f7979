"""Routing metrics, calibration helpers and the gateway hook, on small synthetic inputs."""
from pathlib import Path

import numpy as np
import pytest

from tokenyard.gateway.config.deployment import Routing
from tokenyard.gateway.config.router_settings import parse_router_settings
from tokenyard.gateway.routing.interim_rule import Router
from tokenyard.gateway.routing.learned_router import LearnedRouter, RouterSettings, route_auto
from tokenyard.router_models.runtime.calibration import (
    large_share,
    score_quantiles,
    threshold_for_large_share,
    threshold_from_quantiles,
)
from tokenyard.router_models.training.routing_metrics import (
    apgr,
    cpt,
    oracle_scores,
    random_curve,
    routing_curve,
    threshold_for_quality,
)

ARTIFACT = Path(__file__).resolve().parents[2] / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"


def test_random_routing_apgr_is_half_and_cpt_is_the_target():
    curve = random_curve(0.3, 0.6)
    assert apgr(curve) == pytest.approx(0.5)
    for t in (0.5, 0.8, 0.95):
        assert cpt(curve, t) == pytest.approx(t)


def test_oracle_recovers_the_gap_with_only_the_prompts_that_need_large():
    small = np.array([1, 0, 0, 1, 0, 1, 0, 0], bool)
    large = np.array([1, 1, 0, 0, 1, 1, 1, 0], bool)   # 3 prompts need large, 1 prefers small
    curve = routing_curve(oracle_scores(small, large), small, large)
    assert curve.quality_small == pytest.approx(3 / 8) and curve.quality_large == pytest.approx(5 / 8)
    assert curve.quality.max() == pytest.approx(6 / 8)           # better than either model
    assert cpt(curve, 1.0) == pytest.approx(2 / 8)                # gap is 2 prompts: 2 of the 3 suffice
    assert apgr(curve) > 0.9


def test_curve_moves_ties_together():
    small = np.array([0, 1, 0, 1], bool)
    large = np.array([1, 0, 1, 1], bool)
    curve = routing_curve(np.array([0.2, 0.2, 0.9, 0.9]), small, large)
    assert curve.share.tolist() == [0.0, 0.5, 1.0]
    assert curve.quality.tolist() == [0.5, 0.5, 0.75]


def test_large_share_thresholds():
    rng = np.random.default_rng(0)
    scores = rng.random(5000)
    for share in (0.0, 0.1, 0.3, 0.77, 1.0):
        t = threshold_for_large_share(scores, share)
        assert large_share(scores, t) == pytest.approx(share, abs=1e-3)
        t2 = threshold_from_quantiles(score_quantiles(scores), share)
        assert large_share(scores, t2) == pytest.approx(share, abs=0.005)
    with pytest.raises(ValueError, match="target large share"):
        threshold_for_large_share(scores, 1.5)


def test_quality_target_picks_the_fewest_large_calls():
    small = np.array([0, 0, 1, 1, 1, 0], bool)
    large = np.array([1, 1, 1, 1, 1, 0], bool)
    scores = np.array([0.1, 0.2, 0.5, 0.6, 0.7, 0.8])
    t = threshold_for_quality(scores, small, large, 0.5)
    assert large_share(scores, t) == pytest.approx(1 / 6)
    t = threshold_for_quality(scores, small, large, 1.0)
    assert large_share(scores, t) == pytest.approx(2 / 6)


def _interim():
    return Router(["demo-small", "demo-large"], Routing(small="demo-small", large="demo-large", long_prompt_tokens=64))


def test_without_an_artifact_auto_is_the_interim_rule():
    assert LearnedRouter.from_settings(RouterSettings(), "demo-small", "demo-large") is None
    short = route_auto(None, _interim(), "Add 1 and 2.", 20)
    long = route_auto(None, _interim(), "x " * 200, 300)
    assert (short.engine, short.reason, short.score) == ("demo-small", "auto:short_prompt", None)
    assert (long.engine, long.reason) == ("demo-large", "auto:long_prompt")


def test_learned_router_decides_with_score_and_threshold_override():
    learned = LearnedRouter.from_settings(RouterSettings(artifact=ARTIFACT), "demo-small", "demo-large")
    d = route_auto(learned, _interim(), "Repeat these words: cat dog", 30)
    assert d.reason == "router" and 0.0 < d.score < 1.0
    assert d.engine == ("demo-large" if d.score < learned.threshold else "demo-small")
    assert route_auto(learned, _interim(), "Repeat these words: cat dog", 30, threshold=1.0).engine == "demo-large"
    assert route_auto(learned, _interim(), "Repeat these words: cat dog", 30, threshold=0.0).engine == "demo-small"
    everyone_large = LearnedRouter.from_settings(RouterSettings(artifact=ARTIFACT, target_large_share=1.0),
                                                 "demo-small", "demo-large")
    assert everyone_large.decide("What is 12 + 30?", 25).engine == "demo-large"


def test_router_settings_are_validated(tmp_path):
    engines = {"demo-small": None, "demo-large": None}
    s = parse_router_settings({"artifact": "a.json", "target_large_share": 0.25}, tmp_path, engines)
    assert s.artifact == (tmp_path / "a.json").resolve() and s.target_large_share == 0.25
    with pytest.raises(ValueError, match="router.threshold must be a number"):
        parse_router_settings({"threshold": 2}, tmp_path, engines)
    with pytest.raises(ValueError, match="not both"):
        parse_router_settings({"threshold": 0.5, "target_large_share": 0.2}, tmp_path, engines)
    with pytest.raises(ValueError, match="router.small names engine"):
        parse_router_settings({"small": "nope"}, tmp_path, engines)
    with pytest.raises(ValueError, match="unknown keys"):
        parse_router_settings({"artefact": "x"}, tmp_path, engines)


def test_bootstrap_intervals_cover_the_estimate_and_shrink_with_more_prompts():
    from tokenyard.router_models.training.routing_metrics import bootstrap

    rng = np.random.default_rng(1)

    def draw(n):
        small = rng.random(n) < 0.4
        large = small | (rng.random(n) < 0.3)
        scores = np.where(large & ~small, 0.2, 0.8) + rng.normal(0, 0.3, n)   # an informative, noisy router
        return scores, small, large
    s, sm, lg = draw(400)
    ci = bootstrap(s, sm, lg, resamples=300, seed=0)
    point = apgr(routing_curve(s, sm, lg))
    assert ci["apgr"][0] < point < ci["apgr"][1] and ci["apgr"][0] > 0.5
    assert ci["cpt_95"][0] < cpt(routing_curve(s, sm, lg), 0.95) < ci["cpt_95"][1]
    big = bootstrap(*draw(4000), resamples=300, seed=0)
    assert big["apgr"][1] - big["apgr"][0] < (ci["apgr"][1] - ci["apgr"][0]) / 2
    # paired difference: a router against itself is exactly 0; against random clearly positive
    same = bootstrap(s, sm, lg, resamples=100, baseline=s)["difference_vs_baseline"]
    assert same["apgr"] == [0.0, 0.0]
    vs_random = bootstrap(s, sm, lg, resamples=300, baseline=rng.random(400))["difference_vs_baseline"]
    assert vs_random["apgr"][0] > 0.1
    assert bootstrap(s, sm, lg, resamples=50, seed=3) == bootstrap(s, sm, lg, resamples=50, seed=3)
