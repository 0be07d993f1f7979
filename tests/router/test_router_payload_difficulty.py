"""Feature version 4's input difficulty (tokenyard/router_models/runtime/payload_difficulty.py): the
count of the letter asked about is read from the input whatever the wording, and only where a
sequence of single letters is counted in; the spec refuses it below version 4; old specs load."""
import random

import pytest

from tokenyard.demo import task_suite
from tokenyard.router_models.runtime import features as F
from tokenyard.router_models.runtime.features import DENSE_NAMES, FeatureSpec, extract, row
from tokenyard.router_models.runtime.payload_difficulty import MAX_COUNT, letter_count, signatures


def _spec(**kw) -> FeatureSpec:
    return FeatureSpec(dense_mean=(0.0,) * len(DENSE_NAMES), dense_scale=(1.0,) * len(DENSE_NAMES), **kw)


def test_every_suite_wording_of_a_count_reads_its_answer():
    # phrasings 0-5 of the suite, every letter, counts from 0 up, with and without a system prompt
    rng = random.Random(3)
    task = task_suite.get_task("count")
    for _ in range(300):
        seq = rng.choices("abc", k=rng.choice((4, 6, 9, 12)))
        letter = rng.choice("abc")
        for phrasing in range(6):
            text = task.render({"letter": letter, "seq": " ".join(seq)}, phrasing)
            assert letter_count(rng.choice(("", "Be brief.\n")) + text) == (seq.count(letter), len(seq)), text


@pytest.mark.parametrize("text, expected", [
    ("In the letters b a b c b, how many are b? Thanks.", (3, 5)),      # the letter after the sequence
    ("c c a c -> number of c's", (3, 4)),                                 # "c's"
    ("bs in a b b c please", (2, 4)),                                     # "bs": b occurs in the sequence
    ("Here is a list: b a c c. How often does c occur?", (2, 4)),         # the article "a" gives way to c
    ("count the letter a in a b a c", (2, 4)),                            # "a" alone is taken when it is all there is
    ("Count the letter b in: " + " ".join("b" * 40), (MAX_COUNT, 40)),    # counts are capped
])
def test_the_letter_asked_about_is_found_in_any_layout(text, expected):
    assert letter_count(text) == expected


@pytest.mark.parametrize("text", [
    "Write in capital letters: frog dog cup gold",        # words, no run of single letters
    "Sort these numbers from smallest to largest: 5 3 9",
    "Where does Kuredi live?",
    "a b c",                                             # a sequence, but no letter asked about
    "Count the letter x in: a b",                        # two letters are no sequence
    "",
])
def test_no_signature_without_a_counted_sequence(text):
    assert letter_count(text) is None and signatures(text) == []


def test_signatures_name_the_count_and_the_length():
    assert signatures("Count the letter b in: a b b c") == ["c2", "c2/4"]


def test_the_signatures_enter_the_cross_block_only_with_difficulty():
    text = "Count the letter b in: a b b c a"
    plain, hard = _spec(normalise=True, window=256), _spec(normalise=True, window=256, difficulty=True, version=4)
    a, b = row(text, 20, plain), row(text, 20, hard)
    assert a.ends[:2] == b.ends[:2]                       # words and characters unchanged
    assert b.ends[2] - b.ends[1] > a.ends[2] - a.ends[1]  # more cross entries: the two signatures
    # a prompt with nothing to count gets the same row either way
    other = "Write in capital letters: frog dog"
    assert extract(other, 12, plain) == extract(other, 12, hard)
    # another count changes the row
    assert extract(text, 20, hard) != extract("Count the letter b in: a b c c a", 20, hard)


def test_difficulty_needs_version_4_and_older_specs_load():
    with pytest.raises(ValueError, match="needs version 4"):
        _spec(normalise=True, difficulty=True, version=3).validate()
    v3 = _spec(normalise=True, version=3)
    d = v3.to_dict()
    assert "difficulty" not in d and FeatureSpec.from_dict(d) == v3
    v4 = _spec(normalise=True, difficulty=True, version=4)
    v4.validate()
    assert FeatureSpec.from_dict(v4.to_dict()) == v4
    with pytest.raises(ValueError, match="lacks keys: difficulty"):
        FeatureSpec.from_dict({k: v for k, v in v4.to_dict().items() if k != "difficulty"})
    assert F.FEATURE_VERSION == 4
