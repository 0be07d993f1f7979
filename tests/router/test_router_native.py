"""The router's C feature row (tokenyard/router_models/runtime/native_row.c) is the numpy row, bit for bit:
same columns in the same order, same block factors, same dense values; and a machine without a
C compiler still routes, through numpy, with one warning."""
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenyard.router_models.runtime import artifact, features, native
from tokenyard.router_models.runtime.features import DENSE_NAMES, FeatureSpec, Weights, row, row_numpy
from tokenyard.router_models.runtime.scorer import Scorer
from tokenyard.router_models.training.train import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
ARTIFACT = ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router.json"

kernel_required = pytest.mark.skipif(native.load() is None, reason="the C row kernel could not be built here "
                                     "(no C compiler); the numpy path is what serves")


def _spec(**kw) -> FeatureSpec:
    return FeatureSpec(dense_mean=tuple(0.1 * i for i in range(len(DENSE_NAMES))),
                       dense_scale=tuple(1.0 + 0.5 * i for i in range(len(DENSE_NAMES))), **kw)


def _same(text: str, tokens: int, spec: FeatureSpec) -> None:
    a, b = row(text, tokens, spec), row_numpy(text, tokens, spec)
    assert a.ends == b.ends, text
    assert np.array_equal(a.cols, b.cols), text
    assert a.cols.dtype == b.cols.dtype == np.int64
    # Both take sqrt (correctly rounded) and log1p from the C library: equal in practice; allow
    # 1e-12 relative in case a libm's log1p differs from numpy's by an ulp.
    np.testing.assert_allclose(a.factors, b.factors, rtol=1e-12, atol=0)
    np.testing.assert_allclose(a.dense, b.dense, rtol=1e-12, atol=1e-12)


@kernel_required
def test_every_test_split_prompt_gives_the_numpy_row():
    spec = artifact.load(ARTIFACT).spec
    rows = read_jsonl(ROOT / "tokenyard" / "router_models" / "data" / "test.jsonl")
    for r in rows[::3]:
        _same(features.prompt_text(r["messages"]), int(r["prompt_tokens"]), spec)


_ALPHABET = st.sampled_from(list("abcXYZ019 \n\t:+-*/=<>^%.,;!?'\"()_@#") +
                            ["Ä", "ö", "ß", "İ", "日本", "\u00a0", "\u2003", "\u3000", "\x85", "\x1c", "\U0001F600"])


@kernel_required
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_ALPHABET, max_size=400).map("".join), st.integers(0, 100_000),
       st.sampled_from([(16, (1, 2), (2, 4)), (64, (1, 1), (1, 3)), (512, (2, 2), (3, 5)), (40, (1, 2), (4, 4))]))
def test_any_text_and_spec_give_the_numpy_row(text, tokens, shape):
    window, word_ngrams, char_ngrams = shape
    _same(text, tokens, _spec(window=window, word_ngrams=word_ngrams, char_ngrams=char_ngrams,
                              word_dim=1 << 8, char_dim=1 << 9, cross_dim=1 << 10, cross_weight=1.5))


@kernel_required
def test_words_split_on_exactly_what_python_calls_whitespace():
    # Every code point Python's str.split() splits on, and every other one up to the last of them
    # (none lie beyond U+3000): a wrong one changes the word count, the n-grams, or both.
    spaces = [c for c in range(0x3001) if chr(c).isspace()]
    assert len(spaces) == 29
    spec = _spec(window=1 << 14)
    _same(" ".join(f"a{chr(c)}b" for c in spaces), 7, spec)
    others = [chr(c) for c in range(1, 0x3001) if not chr(c).isspace() and not 0xD800 <= c < 0xE000]
    for i in range(0, len(others), 400):
        _same(" ".join(f"a{ch}b" for ch in others[i:i + 400]), 9, spec)


@kernel_required
def test_long_and_non_ascii_prompts_count_their_newlines_in_full():
    spec = _spec(window=64)
    for text in ("line\n" * 5000 + "What is 2+2?", "zeile\n" * 5000 + "Wie viel ist 2+2? Ä", "\n\n\n", ""):
        _same(text, 10, spec)
        assert features.raw_dense(text, 10, spec)[DENSE_NAMES.index("lines")] == text.count("\n") + 1


def test_a_lone_surrogate_is_scored_not_raised():
    # The gateway refuses lone surrogates at the edge; the feature function itself must not crash
    # on them (a training file read with errors="surrogateescape", say).
    spec = artifact.load(ARTIFACT).spec
    r = row("Repeat: a \ud800 b", 5, spec)
    assert r.cols.size and np.all(np.isfinite(r.dense))
    assert np.array_equal(r.cols, row_numpy("Repeat: a \ud800 b", 5, spec).cols)


@kernel_required
def test_the_scorer_sums_the_same_logit_on_either_path(monkeypatch):
    scorer = Scorer(artifact.load(ARTIFACT))
    texts = [
        features.prompt_text(r["messages"])
        for r in read_jsonl(ROOT / "tokenyard" / "router_models" / "data" / "test.jsonl")[:200]
    ]
    native_z = [scorer.logit(t, len(t) // 4) for t in texts]
    monkeypatch.setattr(features.compiled(scorer.spec), "kernel", None)
    numpy_z = [scorer.logit(t, len(t) // 4) for t in texts]
    # the blocks' weights are summed in a different order (C: sequential; numpy: pairwise)
    np.testing.assert_allclose(native_z, numpy_z, rtol=0, atol=1e-12)


def test_weights_of_the_wrong_size_are_refused():
    spec = artifact.load(ARTIFACT).spec
    with pytest.raises(ValueError, match="columns"):
        row("hello", 1, spec, Weights(np.zeros(spec.dim - 1)))


def test_the_build_is_cached_and_a_missing_compiler_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    if native._compiler() is None:
        pytest.skip("no C compiler on this machine")
    lib = native.build(tmp_path)
    stamp = lib.stat().st_mtime_ns
    assert native.build(tmp_path) == lib and lib.stat().st_mtime_ns == stamp      # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]                   # no temporary left behind
    # no compiler: load() warns once and returns None; rows still come (from numpy)
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None and native.load() is None
    assert sum("numpy path" in r.getMessage() for r in caplog.records) == 1
    spec = _spec()
    assert features.compiled(spec).kernel is None
    assert row("What is 2+2?", 6, spec).cols.size


def test_a_broken_compiler_is_an_error_for_build_and_a_fallback_for_load(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(native, "_compiler", lambda: sys.executable)   # "compiling" with python fails
    with pytest.raises(RuntimeError, match="could not build"):
        native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(native, "_STATE", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.load() is None


def test_the_environment_can_choose_numpy(monkeypatch):
    monkeypatch.setenv("TOKENYARD_ROUTER_NATIVE", "0")
    assert native.load() is None
    spec = _spec()
    assert features.compiled(spec).kernel is None
    r = row("Add 2 and 3:", 4, spec, Weights(np.ones(spec.dim)))
    assert r.sums is not None and r.sums.shape == (4, 1) and math.isclose(float(r.sums[:3].sum()), r.cols.size)
    assert math.isclose(float(r.sums[3, 0]), float(r.dense.sum()), rel_tol=1e-12)


@kernel_required
def test_the_engine_set_scorer_gives_the_same_probabilities_on_either_path(monkeypatch):
    from tokenyard.router_models.runtime.engine_set import EngineScorer, load_router

    scorer = EngineScorer(load_router(ROOT / "tokenyard" / "router_models" / "artifacts" / "demo_router_3.json"))
    texts = [
        features.prompt_text(r["messages"])
        for r in read_jsonl(ROOT / "tokenyard" / "router_models" / "data" / "test.jsonl")[:200]
    ]
    native_p = np.array([scorer.probabilities(t, len(t) // 4) for t in texts])
    monkeypatch.setattr(features.compiled(scorer.spec), "kernel", None)
    numpy_p = np.array([scorer.probabilities(t, len(t) // 4) for t in texts])
    assert native_p.shape == (200, len(scorer.names))
    np.testing.assert_allclose(native_p, numpy_p, rtol=0, atol=1e-12)


_WORDISH = st.sampled_from(["Sort", "these", "numbers", "12", "7", "frog", "dog", "a", "b", "Anna", "the", "words",
                            "Capital", "letters", ":", ".", "?", "\n", "+", "revrese", "uppercase", "Ä", "日本"])


@kernel_required
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_WORDISH, max_size=60).map(" ".join), st.integers(0, 5000))
def test_normalised_features_give_the_numpy_row(text, tokens):
    # version 3: both paths read layout.canonical's form, filtered by the vocabulary
    spec = features.with_vocabulary(_spec(normalise=True, window=256, word_dim=1 << 8, char_dim=1 << 9,
                                          cross_dim=1 << 10),
                                    ["Sort these numbers: 1 2", "Write in capital letters: frog dog", "reverse the words"])
    _same(text, tokens, spec)


@kernel_required
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(["Count", "the", "letter", "a", "b", "c", "c's", "bs", "in", ":", "how", "many",
                                 "?", ".", "\n", "frog", "12", "I"]), max_size=60).map(" ".join),
       st.integers(0, 5000))
def test_difficulty_features_give_the_numpy_row(text, tokens):
    # version 4: payload_difficulty's signatures reach both paths' cross blocks alike
    spec = features.with_vocabulary(_spec(normalise=True, window=256, difficulty=True, version=4, word_dim=1 << 8,
                                          char_dim=1 << 9, cross_dim=1 << 10),
                                    ["Count the letter a in: a b c", "Write in capital letters: frog dog"])
    _same(text, tokens, spec)
