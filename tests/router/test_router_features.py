"""Router features, version 2: the hashing is what the docstring says it is, the work per request is
bounded by the window, and novelty and payload kind read the instruction, not its wording."""
import re

import numpy as np
import pytest

from tokenyard.router_models.runtime import features as F
from tokenyard.router_models.runtime.features import (
    DENSE_NAMES,
    FeatureSpec,
    extract,
    row,
    vocabulary_of,
    window_of,
    with_vocabulary,
)

M = 1 << 64


def _poly(text: str) -> int:
    h = 0
    for ch in text:
        h = (h * F._P + ord(ch)) % M
    return h


def _spec(**kw) -> FeatureSpec:
    return FeatureSpec(dense_mean=(0.0,) * len(DENSE_NAMES), dense_scale=(1.0,) * len(DENSE_NAMES), **kw)


TEXT = "Be brief.\nHow many times does the letter a appear in: a b c a ÄÖ x+y=3 ok 123 45 Oslo"


def test_vectorised_hashes_are_the_per_word_definitions():
    words = TEXT.lower().split()
    cp = F._codepoints(" " + " ".join(words) + " ")
    # character 2-4-grams of each " word ", never across two words
    expected = sorted((_poly(f" {w} "[i:i + n]) + n) % M for n in range(2, 5) for w in words
                      for i in range(len(w) + 3 - n))
    assert sorted(F._char_hashes(cp, 2, 4).tolist()) == expected
    # tokens: [a-z]+ | \d+ | one other character
    tokens = re.findall(r"[a-z]+|\d+|[^\sa-z\d]", " ".join(words))
    t = F._tokens(cp)
    assert t.hashes.tolist() == [(_poly(x) + len(x) * 0x2545F491) % M for x in tokens]
    assert t.numeric.tolist() == [x.isdigit() for x in tokens] and t.digits == 6


def test_only_the_window_is_read_so_long_prompts_cost_what_short_ones_do():
    spec = _spec(window=256)
    tail = "Summarise the notes above in one line: " + " ".join(f"w{i}" for i in range(20))
    short = "intro words here\n" + tail
    long = "lorem ipsum dolor " * 5000 + "\n" + tail
    a, b = row(short, 40, spec), row(long, 20_000, spec)
    assert b.cols.size == row(window_of(long, 256), 20_000, spec).cols.size <= 2 * a.cols.size
    assert window_of(long, 256).endswith(tail) and len(window_of(long, 256)) <= 256
    assert not window_of("abc defgh", 6).startswith("fgh")              # no word cut in two
    # the whole prompt still counts through its length features
    dense = dict(zip(DENSE_NAMES, F.raw_dense(long, 20_000, spec)))
    assert dense["tokens"] == 20_000 and dense["chars"] == len(long) and dense["lines"] == 2


def test_novelty_masks_names_and_numbers_and_sees_new_wording():
    vocab = vocabulary_of(["Where does Kavomi live?", "Add 3 and 4.", "Repeat these words: a b"])
    spec = _spec(vocabulary=vocab)

    def novelty(text):
        return dict(zip(DENSE_NAMES, F.raw_dense(text, 10, spec)))["novelty"]
    assert novelty("Where does Pelomu live?") == 0.0 and novelty("Add 912 and 4417.") == 0.0
    assert novelty("Repeat these words: cat dog owl") == 0.0
    assert novelty("Tell me the town Pelomu calls home.") > 0.5 and novelty("Find the total of 5 plus 6.") > 0.5
    assert 0.0 < novelty("Where does Pelomu reside?") < novelty("In what town does Pelomu reside?")


def test_payload_kind_reads_the_payload_not_the_wording():
    kind = [F._payload_kind(F.instruction(t)) for t in (
        "Repeat these words: cat dog owl", "Echo this list unchanged: sun map key",
        "Sort these numbers: 3 1 2", "Rank these values, lowest first: 9 8 7",
        "Where does Kavomi live?", "Tell me the town Kavomi calls home.", "Add 3 and 4.", "Find the total of 3 plus 4.")]
    assert kind[0] == kind[1] == "lower|n0|a0" and kind[2] == kind[3] == "num|n0|a0"
    assert kind[4] == kind[5] == "none|n0|a1" and kind[6] == kind[7] == "none|n2|a0"


def test_extract_is_the_row_the_scorer_reads():
    spec = _spec(vocabulary=vocabulary_of(["Where does Kavomi live?"]))
    r = row(TEXT, 30, spec)
    x = extract(TEXT, 30, spec)
    assert [x[i] for i in range(len(DENSE_NAMES))] == pytest.approx(r.dense.tolist(), abs=0)
    # each hashed block is L2-normalised to its weight (cross: cross_weight)
    bounds = [len(DENSE_NAMES), len(DENSE_NAMES) + spec.word_dim, len(DENSE_NAMES) + spec.word_dim + spec.char_dim,
              spec.dim]
    for lo, hi, weight in zip(bounds, bounds[1:], (1.0, 1.0, spec.cross_weight)):
        block = np.array([v for c, v in x.items() if lo <= c < hi])
        assert np.linalg.norm(block) == pytest.approx(weight, rel=1e-12)
    assert extract("", 0, spec) == extract("", 0, spec) and len(extract("", 0, spec)) > len(DENSE_NAMES)


def test_spec_validation_refuses_what_the_code_cannot_compute():
    for bad in (dict(window=8), dict(word_ngrams=(1, 3)), dict(vocabulary=(1 << 33,))):
        with pytest.raises(ValueError):
            _spec(**bad).validate()
    spec = _spec()
    spec.validate()
    assert FeatureSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="version 1 is not supported"):
        FeatureSpec.from_dict({**spec.to_dict(), "version": 1})


def test_version_2_specs_still_load_and_normalise_needs_version_3():
    # the three-engine artifacts carry version-2 specs (text as written): they load and round-trip
    v2 = _spec(version=2)
    d = v2.to_dict()
    assert "normalise" not in d and FeatureSpec.from_dict(d) == v2
    with pytest.raises(ValueError, match="normalise"):
        _spec(version=2, normalise=True).validate()
    v3 = _spec(normalise=True)
    v3.validate()
    assert FeatureSpec.from_dict(v3.to_dict()) == v3
    with pytest.raises(ValueError, match="lacks keys: normalise"):
        FeatureSpec.from_dict({k: v for k, v in v3.to_dict().items() if k != "normalise"})


def test_normalised_features_read_the_request_not_its_layout():
    spec = with_vocabulary(_spec(normalise=True, window=256), ["Sort these numbers from low to high: 4 1 3"])
    same = ["Sort these numbers from low to high: 9 2 5",
            "9 2 5 - sort these numbers from low to high.",
            "Hello there. Sort these numbers, from low to high: 9 2 5",
            "srot these numbers from low to high 9 2 5"]        # a typo: one swapped pair of letters
    rows = [extract(t, 20, spec) for t in same]
    # the dense counts may differ (token count, characters); the hashed blocks may not
    hashed = [{c: v for c, v in r.items() if c >= spec.n_dense} for r in rows]
    assert all(h == hashed[0] for h in hashed[1:])
    assert F.view("Please sort 9 2 5, thanks a lot", spec) == "sort : 9 2 5"
    # words the training prompts never used are left out (they have no weights, only noise)
    assert F.view("Kindly rearrange 9 2 5", spec) == " : 9 2 5"
