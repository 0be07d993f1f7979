"""The C masked argmax (tokenyard/kernels/cpu_masked_argmax.py) gives the tokens of numpy's argmax over
torch.where(allowed, logits, -inf), the path it replaces: first maximum, a NaN wins, 0 when nothing
allowed beats -inf, bits past the vocabulary ignored. Tokens are integers: compared exactly."""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from tokenyard.engines.model.sampler import sample
from tokenyard.engines.model.token_masks import TokenMasks, _unpack_device
from tokenyard.kernels import cpu_masked_argmax


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    k = cpu_masked_argmax.load()
    assert k is not None, "a C compiler is on PATH, so the kernel must build"
    return k


def _reference(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, vocab: int) -> list[int]:
    allowed = _unpack_device(bitmask, vocab, torch.device("cpu"))
    masked = torch.where(allowed, logits[rows][:, :vocab], torch.tensor(float("-inf")))
    return np.argmax(masked.numpy(), axis=-1).tolist()


def _bitmask(rng: random.Random, n: int, vocab: int, words: int) -> torch.Tensor:
    out = torch.zeros(n, words, dtype=torch.int32)
    for r in range(n):
        kind = rng.choice(["empty", "one", "sparse", "dense", "full", "full_words"])
        bits = np.zeros(words * 32, dtype=bool)
        if kind == "one":
            bits[rng.randrange(vocab)] = True
        elif kind == "sparse":
            bits[[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]] = True
        elif kind == "dense":
            bits[:] = np.random.default_rng(rng.randrange(1 << 30)).random(words * 32) < 0.7
        elif kind == "full":
            bits[:] = True                       # bits past the vocabulary set too: ignored
        elif kind == "full_words":
            for w in rng.sample(range(words), k=max(1, words // 3)):
                bits[w * 32:(w + 1) * 32] = True
        packed = np.packbits(bits, bitorder="little").view(np.int32)
        out[r] = torch.from_numpy(packed.copy())
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49152])
def test_matches_the_masked_argmax(kernel, vocab):
    rng = random.Random(vocab)
    words = (vocab + 31) // 32 + (1 if vocab % 7 == 0 else 0)     # sometimes a padded word count
    for trial in range(6):
        s = rng.randrange(1, 9)
        logits = torch.randn(s, vocab + rng.choice([0, 0, 5]))[:, :vocab]   # sometimes a row stride > vocab
        if trial % 2:
            logits = torch.round(logits * 2) / 2                              # many ties: the first must win
        if trial == 3:
            logits[0, rng.randrange(vocab)] = float("nan")
            logits[:, rng.randrange(vocab)] = float("-inf")
        if trial == 4:
            logits[:] = float("-inf")
        rows = [rng.randrange(s) for _ in range(rng.randrange(1, 6))]
        bitmask = _bitmask(rng, len(rows), vocab, words)
        assert kernel.argmax(logits, rows, bitmask, vocab) == _reference(logits, rows, bitmask, vocab), (vocab, trial)


def test_bad_shapes_are_refused(kernel):
    logits = torch.randn(2, 64)
    with pytest.raises(ValueError, match="bitmask"):
        kernel.argmax(logits, [0, 1], torch.zeros(1, 2, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="bitmask"):
        kernel.argmax(logits, [0], torch.zeros(1, 1, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="outside"):
        kernel.argmax(logits, [2], torch.zeros(1, 2, dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="fp32"):
        kernel.argmax(logits.double(), [0], torch.zeros(1, 2, dtype=torch.int32), 64)


class _Fixed:
    """A stand-in constraint that allows a fixed token set (anything with fill_bitmask will do)."""

    def __init__(self, allowed: list[int], vocab: int) -> None:
        self.allowed, self.vocab = allowed, vocab

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = np.zeros(bitmask.shape[1] * 32, dtype=bool)
        bits[self.allowed] = True
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32).copy())


@pytest.mark.parametrize("mode", ["native", "torch"])
def test_sample_takes_greedy_rows_under_their_masks(kernel, monkeypatch, mode):
    """A batch mixing greedy and seeded rows, constrained and not: the same tokens with the kernel and
    with the torch select, and every constrained row's token allowed by its mask."""
    monkeypatch.setenv("TOKENYARD_MASKED_ARGMAX", mode)
    vocab, s = 300, 6
    torch.manual_seed(0)
    logits = torch.randn(s, vocab)
    cons = [_Fixed([5, 77, 299], vocab), None, _Fixed([1, 2, 3], vocab), _Fixed(list(range(0, 300, 2)), vocab), None,
            _Fixed([42], vocab)]
    greedy = [True, True, False, True, False, True]
    got = sample(logits, greedy, [0.0, 0.0, 0.8, 0.0, 1.1, 0.0], [0] * s, [1.0] * s, [11] * s, [3] * s, cons)
    for i, c in enumerate(cons):
        if c is not None:
            assert got[i] in c.allowed
    for i in (0, 3, 5):   # greedy constrained: the best allowed logit
        assert got[i] == max(cons[i].allowed, key=lambda t: logits[i, t].item())
    assert got[1] == int(logits[1].argmax())
    monkeypatch.setenv("TOKENYARD_MASKED_ARGMAX", "torch" if mode == "native" else "native")
    again = sample(logits, greedy, [0.0, 0.0, 0.8, 0.0, 1.1, 0.0], [0] * s, [1.0] * s, [11] * s, [3] * s, cons)
    assert again == got


def test_greedy_equals_apply_then_argmax_on_any_device_path(kernel, monkeypatch):
    vocab = 500
    rng = random.Random(3)
    bitmask = _bitmask(rng, 4, vocab, (vocab + 31) // 32)
    masks = TokenMasks(bitmask, None, vocab)
    logits = torch.randn(7, vocab)
    rows = [6, 0, 3, 3]
    native = masks.greedy(logits, rows)
    monkeypatch.setenv("TOKENYARD_MASKED_ARGMAX", "torch")
    assert masks.greedy(logits, rows) == native == _reference(logits, rows, bitmask, vocab)
