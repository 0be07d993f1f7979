"""Training-time perturbations (tokenyard/router_models/training/augment.py): seeded, labels and
outcomes kept, the input never edited, and nothing taken from the rewording benchmark's grammar."""
import random
import re
from pathlib import Path

import numpy as np

from tokenyard.router_models.training import augment as A
from tokenyard.router_models.training.train import from_rows

ROOT = Path(__file__).resolve().parents[2]


def _rows():
    return from_rows([
        {"prompt": "Answer with the result only.\nReverse these words: lamp tree rock sun", "label": 1,
         "prompt_tokens": 30, "small_correct": True, "large_correct": True},
        {"prompt": "What is 41 + 17?", "label": 0, "prompt_tokens": 12, "small_correct": False,
         "large_correct": True},
        {"prompt": "Where does Tomas Verde live?", "label": 1, "prompt_tokens": 14, "small_correct": True,
         "large_correct": False},
    ])


def test_copies_keep_labels_and_outcomes_and_are_seeded():
    data = _rows()
    a, b = A.augment(data, copies=3, seed=5), A.augment(data, copies=3, seed=5)
    assert a.texts == b.texts and len(a) == 9
    assert a.labels.tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert np.array_equal(a.large_correct, np.repeat(data.large_correct, 3))
    assert A.augment(data, copies=3, seed=6).texts != a.texts
    assert all(n >= 1 for n in a.tokens)


def test_the_input_and_the_system_message_are_never_edited():
    rng = random.Random(0)
    for _ in range(300):
        out = A.perturb("Reverse these words: lamp tree rock sun", rng)
        assert "lamp tree rock sun" in out.lower()
        out = A.perturb("What is 41 + 17?", rng)
        assert "41" in out and "17" in out
        out = A.perturb("Where does Tomas Verde live?", rng)
        assert "Tomas" in out and "Verde" in out or "tomas verde" in out
    copies = A.augment(_rows(), copies=20, seed=1)
    assert all(t.startswith("Answer with the result only.\n") for t in copies.texts[:20])


def test_nothing_is_taken_from_the_rewording_benchmark():
    # the benchmark's grammar is the test of new wording: no three words in a row of our filler
    # sentences, and no wrapper or trailer of three words or more, appear in it (lower case,
    # placeholders removed). Two-word wrappers ("could you") are any question's English.
    grammar = " ".join(re.findall(r"[a-z']+", (ROOT / "tokenyard" / "bench" / "rewording_grammar.py").read_text().lower()))
    pieces = [w.replace("{}", " ") for w in A.WRAPPERS] + list(A.TRAILERS)
    for text in A.FILLERS:
        words = re.findall(r"[a-z']+", text.lower())
        pieces += [" ".join(words[i:i + 3]) for i in range(max(1, len(words) - 2))]
    for piece in pieces:
        for part in re.split(r"\s{2,}", piece.strip().lower()):
            needle = " ".join(re.findall(r"[a-z']+", part))
            if len(needle.split()) >= 3:
                assert f" {needle} " not in f" {grammar} ", piece
    source = (ROOT / "tokenyard" / "router_models" / "training" / "augment.py").read_text()
    assert "import" not in source.split("rewording_grammar")[1][:20]
