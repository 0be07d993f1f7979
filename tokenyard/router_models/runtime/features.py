"""Cheap prompt features for the router: a pure function of (prompt text, token count, spec).

Only the last `spec.window` characters of the prompt are read (the instruction and its payload
sit at the end of a chat prompt), plus the full length as numbers: the token count (passed in),
the character count and the number of lines. So a decision costs the same for an 8k-token prompt
as for a 300-character one. The row is computed in C (native_row.c, loaded by native.py):
one pass over the window, ~70 us a decision) or, where no C compiler exists, by the same
definitions vectorised in numpy (`row_numpy`, ~3x slower; tests/router/test_router_native.py holds
the two equal). Neither keeps a cache, so there is no cold/warm difference either.

Four blocks, laid out in one vector of `spec.dim` columns:
  dense   [0, n_dense)                  counts over the window (words, digits, numbers, longest
                                        number, operators, capitals, ...), token/char/line counts
                                        of the whole prompt, and the instruction's novelty; as
                                        log1p, standardised with the train mean/scale in the spec
  words   [n_dense, n_dense + word_dim) hashed word 1-2-grams (tokens: [a-z]+, \\d+, or one other
                                        character, lower case), L2-normalised
  chars   [.., + char_dim)              hashed character 2-4-grams of " word " (lower case),
                                        L2-normalised
  cross   [.., dim)                     hashed crosses, L2-normalised, times `cross_weight`

The cross block is what lets a linear model say "for *this* kind of instruction, *this* size is
hard": the last line is split at its last colon into an instruction and a payload (no colon: all
of it is the instruction); every instruction word is crossed with each size signature (payload
words, count of numbers, digits in the longest number, token count // 4), plus the signatures
alone. Version 2 adds what generalises to wording the router never saw:
  payload kind  what the last line carries, from its tokens, never its wording: the payload's
                token class (numbers, single letters, lower-case words, capitals, mixed, none),
                how many numbers and names (capitalised words not first on the line) the
                last line holds; crossed with each size signature;
  novelty       the share of the instruction's word 1-2-grams (numbers and names masked) absent
                from `spec.vocabulary` (the hashed 1-2-grams of the router's training prompts), a
                dense feature and, bucketed, crossed with the payload kind and the sizes.
An instruction in unfamiliar wording has no trained weights on its own words; the kind and
novelty crosses still place it. Version 3 (`spec.normalise`, issue 51) computes all of the above
on `view(text)`: the layout-free form of the prompt's end (layout.canonical: "instruction words :
input" on one line, from the sentence that holds the input), without the instruction words the
training prompts never used (one typo repaired first), and without the token count in the size
crosses; the dense token count stays. Version 4 (`spec.difficulty`) adds payload_difficulty's
signatures (the count of the letter asked about, read from the window as written) to the size
signatures of the cross block. Version-2 and -3 specs still load and score as they did.

Hashes: word and character n-grams are polynomial hashes (mod 2^64) of code points, mixed by a
multiply-shift, modulo the block size; the few instruction words and signatures are crc32 of
their UTF-8. All stable across processes and machines (no PYTHONHASHSEED). The token count is
passed in (the gateway counts it once with the serving tokenizer); nothing here imports engines.

`blocks(text, tokens, spec)` gives the dense values and each hashed block's column array (one
entry per n-gram occurrence) with its L2 norm; `extract` turns that into a sparse row
{column: value}; `matrix(...)` stacks rows into a scipy CSR matrix for training. The trainer
(through `extract`) and the scorer (through `blocks`) share one feature function, so what is
trained is exactly what is served.
"""
from __future__ import annotations

import math
import re
import zlib
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from tokenyard.router_models.runtime import native
from tokenyard.router_models.runtime.layout import canonical, stem
from tokenyard.router_models.runtime.payload_difficulty import signatures

FEATURE_VERSION = 4
SUPPORTED_VERSIONS = (2, 3, 4)   # 2: read as written; 3 adds `normalise` (layout.py); 4 `difficulty`
DENSE_NAMES = ("tokens", "chars", "words", "digits", "numbers", "longest_number", "operators",
               "capitals", "punctuation", "distinct_words", "lines", "question", "novelty", "novel_grams")
MAX_WINDOW = 1 << 14
DEFAULT_WINDOW = 512
MAX_INSTRUCTION_WORDS = 24       # the last words of a long instruction; bounds the cross block
MAX_PAYLOAD_TOKENS = 64          # payload tokens whose class is read (the last ones)
_SCAN = 8 * MAX_INSTRUCTION_WORDS
_TOKEN = re.compile(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]")
_NUMBER = re.compile(r"\d+")
_SPACE = re.compile(r"\s")
_OPERATORS = b"+-*/=<>^%"
_PUNCT = b".,;:!?'\"()"
_CAPITALS = bytes(range(65, 91))              # ASCII capitals

_P = 0x100000001B3                       # polynomial base (odd: invertible mod 2^64)
_Q = pow(_P, -1, 1 << 64)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_SHIFT = np.uint64(29)
_SALT_WORD, _SALT_BIGRAM, _SALT_CHAR, _SALT_CROSS = (np.uint64(x) for x in (
    0x51ED27, 0xB16A3, 0xC4A25, 0xC2055))


@dataclass(slots=True)
class FeatureSpec:
    """Everything that decides a feature vector; stored in the artifact and checked at load."""

    word_dim: int = 1 << 12
    char_dim: int = 1 << 12
    cross_dim: int = 1 << 14
    cross_weight: float = 2.0
    word_ngrams: tuple[int, int] = (1, 2)
    char_ngrams: tuple[int, int] = (2, 4)
    lowercase: bool = True
    window: int = DEFAULT_WINDOW                        # characters read from the end of the prompt
    vocabulary: tuple[int, ...] = ()                    # set by `with_vocabulary`
    dense: tuple[str, ...] = DENSE_NAMES
    dense_mean: tuple[float, ...] = field(default_factory=tuple)   # set by `fit_normalisation`
    dense_scale: tuple[float, ...] = field(default_factory=tuple)
    normalise: bool = False                             # version 3: score layout.canonical(text)
    difficulty: bool = False                            # version 4: payload_difficulty signatures
    version: int = FEATURE_VERSION

    @property
    def n_dense(self) -> int:
        return len(self.dense)

    @property
    def dim(self) -> int:
        return self.n_dense + self.word_dim + self.char_dim + self.cross_dim

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in ("word_ngrams", "char_ngrams", "vocabulary", "dense", "dense_mean", "dense_scale"):
            d[key] = list(getattr(self, key))
        if self.version < 4:
            del d["difficulty"]     # version 2 and 3 files are written as they were
        if self.version == 2:
            del d["normalise"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "FeatureSpec":
        known = set(cls.__dataclass_fields__)
        if int(d.get("version", -1)) not in SUPPORTED_VERSIONS:
            raise ValueError(f"feature spec version {d.get('version')!r} is not supported (this code: "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))}); retrain the router with "
                             "`tokenyard router train`")
        if int(d["version"]) < 4:       # version 2 and 3 specs predate `difficulty`
            known.discard("difficulty")
        if int(d["version"]) == 2:      # version 2 specs predate `normalise`: text as written
            known.discard("normalise")
        extra = set(d) - known
        if extra:
            raise ValueError(f"feature spec has unknown keys: {', '.join(sorted(extra))}")
        missing = known - set(d)
        if missing:
            raise ValueError(f"feature spec lacks keys: {', '.join(sorted(missing))}")
        return cls(word_dim=int(d["word_dim"]), char_dim=int(d["char_dim"]), cross_dim=int(d["cross_dim"]),
                   cross_weight=float(d["cross_weight"]),
                   word_ngrams=_ngram_range(d, "word_ngrams"), char_ngrams=_ngram_range(d, "char_ngrams"),
                   lowercase=bool(d["lowercase"]), window=int(d["window"]),
                   vocabulary=tuple(int(x) for x in d["vocabulary"]),
                   dense=tuple(str(x) for x in d["dense"]),
                   dense_mean=tuple(float(x) for x in d["dense_mean"]),
                   dense_scale=tuple(float(x) for x in d["dense_scale"]),
                   normalise=bool(d.get("normalise", False)), difficulty=bool(d.get("difficulty", False)),
                   version=int(d["version"]))

    def validate(self) -> None:
        if self.version not in SUPPORTED_VERSIONS:
            raise ValueError(f"feature spec version {self.version} is not supported (this code: "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))})")
        if self.version == 2 and self.normalise:
            raise ValueError("feature spec version 2 has no normalise; it needs version 3")
        if self.version < 4 and self.difficulty:
            raise ValueError(f"feature spec version {self.version} has no difficulty; it needs version 4")
        if tuple(self.dense) != DENSE_NAMES:
            raise ValueError(f"feature spec dense features {list(self.dense)} differ from this code's "
                             f"{list(DENSE_NAMES)}")
        if self.word_dim <= 0 or self.char_dim <= 0 or self.cross_dim <= 0:
            raise ValueError("feature spec hashing dims must be positive")
        for name, (lo, hi) in (("word_ngrams", self.word_ngrams), ("char_ngrams", self.char_ngrams)):
            if not 1 <= lo <= hi <= 8:
                raise ValueError(f"feature spec {name} must be 1 <= lo <= hi <= 8, got {[lo, hi]}")
        if self.word_ngrams[1] > 2:
            raise ValueError("feature spec word_ngrams: at most 2 (unigrams and bigrams)")
        if not 16 <= self.window <= MAX_WINDOW:
            raise ValueError(f"feature spec window must lie in [16, {MAX_WINDOW}] characters, got {self.window}")
        if any(not 0 <= v < 1 << 32 for v in self.vocabulary):
            raise ValueError("feature spec vocabulary entries must be 32-bit hashes")
        if len(self.dense_mean) != self.n_dense or len(self.dense_scale) != self.n_dense:
            raise ValueError("feature spec normalisation must have one mean and one scale per dense feature")
        if not math.isfinite(self.cross_weight) or self.cross_weight < 0:
            raise ValueError("feature spec cross_weight must be a finite number >= 0")
        if any(s <= 0 or not math.isfinite(s) for s in self.dense_scale):
            raise ValueError("feature spec dense_scale values must be positive and finite")


def _ngram_range(d: Mapping, key: str) -> tuple[int, int]:
    """A spec's (lowest, highest) n-gram order, refused unless it is exactly two integers."""
    value = [int(x) for x in d[key]]
    if len(value) != 2:
        raise ValueError(f"feature spec {key} must be [lowest, highest], got {d[key]!r}")
    return value[0], value[1]


def prompt_text(messages: Iterable[Mapping[str, str]]) -> str:
    """The text the router scores: every message's content, in order, joined by newlines."""
    return "\n".join(str(m.get("content") or "") for m in messages)


def window_of(text: str, size: int) -> str:
    """The last `size` characters, without a word cut in two at the start."""
    if len(text) <= size:
        return text
    tail = text[-size:]
    if text[-size - 1].isspace():
        return tail
    m = _SPACE.search(tail)
    return tail[m.start():] if m else tail


# --- the instruction: last line, names and numbers masked --------------------------------------

def _crc(gram: str) -> int:
    return _crc32(gram.encode("utf-8", "surrogatepass"))


_crc32 = zlib.crc32


@dataclass(slots=True)
class Instruction:
    words: list[str]        # lower-case alphabetic words of the instruction (crossed with sizes)
    grams: list[int]        # crc32 of its masked word 1-2-grams (novelty)
    tail: str               # the payload after the last colon ("" without one)
    numbers: list[str]      # numbers on the last line
    names: int              # capitalised words not first on the last line


def instruction(window: str) -> Instruction:
    """The last line split at its last colon; the instruction's tokens masked: numbers as "#",
    names (capitalised words, but the line's first) as "@", the rest in lower case."""
    last = window.rsplit("\n", 1)[-1]
    head, tail = last.rsplit(":", 1) if ":" in last else (last, "")
    tokens = _TOKEN.findall(head[-_SCAN:])[-MAX_INSTRUCTION_WORDS:]
    masked: list[str] = []
    names = 0
    for i, tok in enumerate(tokens):
        if tok.isdigit():
            masked.append("#")
            continue
        low = tok.lower()
        if tok[0].isupper() and i > 0:
            masked.append("@")
            names += 1
        else:
            masked.append(low)
    # (crc32 inline: the call is a third of the cost of these few dozen hashes)
    grams = ([_crc32(("u " + g).encode("utf-8", "surrogatepass")) for g in masked]
             + [_crc32(f"b {a} {b}".encode("utf-8", "surrogatepass")) for a, b in zip(masked, masked[1:])])
    names += sum(1 for tok in tail.split()[-MAX_PAYLOAD_TOKENS:] if tok[:1].isupper() and tok[1:].islower()
                 and len(tok) > 1)
    words = sorted({t for t in masked if t.isalpha()})
    return Instruction(words, grams, tail, _NUMBER.findall(last), names)


def view(text: str, spec: "FeatureSpec") -> str:
    """The text the features read: as written, or (spec.normalise) the layout-free form of its
    last `spec.window` characters (layout.canonical)."""
    if not spec.normalise:
        return text
    canon = canonical(window_of(text, spec.window))
    if not spec.vocabulary:
        return canon
    known = compiled(spec).vocabulary
    head, sep, tail = canon.partition(" : ")
    kept = [w if w[:1].isupper() else _known(w, known) for w in head.split()]
    return " ".join(w for w in kept if w) + sep + tail


def _known(word: str, known: frozenset[int]) -> str | None:
    """`word` if the training instructions used it; else the first used word one typo away (two
    letters swapped, or one letter too many), else None."""
    if _crc32(("u " + word).encode("utf-8", "surrogatepass")) in known:
        return word
    if len(word) < 4:
        return None
    n = len(word)
    for cand in [word[:i] + word[i + 1] + word[i] + word[i + 2:] for i in range(n - 1)] + \
            [word[:i] + word[i + 1:] for i in range(n)]:
        cand = stem(cand)
        if _crc32(("u " + cand).encode("utf-8", "surrogatepass")) in known:
            return cand
    return None


def vocabulary_of(texts: Iterable[str], window: int = DEFAULT_WINDOW, normalise: bool = False) -> tuple[int, ...]:
    """Hashed masked instruction 1-2-grams of these (training) prompts, sorted."""
    seen: set[int] = set()
    for text in texts:
        w = window_of(text, window)
        seen.update(instruction(canonical(w) if normalise else w).grams)
    return tuple(sorted(seen))


def _payload_kind(ins: Instruction) -> str:
    toks = ins.tail.split()[-MAX_PAYLOAD_TOKENS:]
    if not toks:
        cls = "none"
    else:
        kinds = {"num" if t.isdigit() else "letter" if len(t) == 1 and t.isalpha() else
                 "lower" if t.isalpha() and t.islower() else "upper" if t.isalpha() and t.isupper() else
                 "cap" if t.isalpha() else "other" for t in toks}
        cls = kinds.pop() if len(kinds) == 1 else "mixed"
    head_numbers = len(ins.numbers) - len(_NUMBER.findall(ins.tail))
    return f"{cls}|n{min(head_numbers, 3)}|a{min(ins.names, 2)}"


def _novelty(ins: Instruction, vocabulary: frozenset[int]) -> tuple[float, int]:
    if not ins.grams:
        return 0.0, 0
    unseen = sum(1 for g in ins.grams if g not in vocabulary)
    return unseen / len(ins.grams), unseen


# --- vectorised hashing ---------------------------------------------------------------------------

_POW: dict[str, np.ndarray] = {}
_U = np.uint64


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """P^k and Q^k (mod 2^64) for k < n (grown on demand; pure)."""
    have = _POW.get("p")
    if have is None or have.size < n:
        size = max(n, 2 * (0 if have is None else have.size), 2 * DEFAULT_WINDOW + 8)
        for key, base in (("p", _P), ("q", _Q)):
            steps = np.full(size, base, dtype=np.uint64)
            steps[0] = 1
            _POW[key] = np.cumprod(steps, dtype=np.uint64)
    return _POW["p"], _POW["q"]


def _codepoints(s: str) -> np.ndarray:
    return np.frombuffer(s.encode("utf-32-le", "surrogatepass"), dtype="<u4").astype(np.uint64)


def _char_hashes(cp: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Hashes of the n-grams (lo <= n <= hi) of the padded, single-spaced text that have no space
    inside them (only at their ends): exactly the n-grams of each " word "."""
    space = cp == 32
    h = cp
    inner = np.zeros(cp.size, dtype=bool)
    out = []
    for n in range(1, hi + 1):
        if n > 1:
            h = h[:-1] * _U(_P) + cp[n - 1:]
            inner = inner[:-1] | space[n - 2:-1] if n > 2 else inner[:-1]
        if n >= lo and h.size:
            out.append(h[~(space if n == 1 else inner)] + _U(n))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


@dataclass(slots=True)
class _Tokens:
    hashes: np.ndarray      # polynomial hash of each token (plus its length)
    lengths: np.ndarray
    numeric: np.ndarray     # bool: the token is a run of digits
    digits: int             # digit characters in the text


def _tokens(cp: np.ndarray) -> _Tokens:
    r"""The tokens of the lower-case, single-spaced text: a run of a-z, a run of digits, or any
    other single non-space character (the regex [a-z]+|\d+|[^\sa-z\d])."""
    alpha = (cp - _U(97)) < _U(26)
    digit = (cp - _U(48)) < _U(10)
    other = ~(alpha | digit) & (cp != 32)
    cls = alpha.view(np.uint8) + 2 * digit.view(np.uint8) + 3 * other.view(np.uint8)
    change = np.empty(cp.size + 1, dtype=bool)
    change[0] = change[-1] = True
    np.not_equal(cls[1:], cls[:-1], out=change[1:-1])
    word = cls != 0
    starts = np.flatnonzero(word & (change[:-1] | other))
    ends = np.flatnonzero(word & (change[1:] | other)) + 1
    ppow, qpow = _powers(cp.size + 1)
    g = np.zeros(cp.size + 1, dtype=np.uint64)
    np.cumsum(cp * qpow[: cp.size], dtype=np.uint64, out=g[1:])
    lengths = ends - starts
    hashes = ppow[ends - 1] * (g[ends] - g[starts]) + lengths.astype(np.uint64) * _U(0x2545F491)
    return _Tokens(hashes, lengths, digit[starts], int(np.count_nonzero(digit)))


@dataclass(slots=True)
class Row:
    """One prompt's features before the hashed blocks are scaled: standardised dense values
    (columns 0..n_dense-1); the columns of every hashed n-gram occurrence, block after block
    (words, chars, cross; `ends` marks where each block's entries end in `cols`); and per block
    the factor its counts are scaled by (weight / the L2 norm of its count vector; 0 if empty)."""
    dense: np.ndarray
    cols: np.ndarray
    ends: tuple[int, int, int]
    factors: np.ndarray
    sums: np.ndarray | None = None      # with `weights` (k models): (4, k), each hashed block's sum of its
                                        # occurrences' weights, then dense @ their weights

    def weight_sums(self) -> np.ndarray:
        """`sums`, which only a row built with weights has."""
        if self.sums is None:
            raise ValueError("this feature row was built without weights: it has no sums")
        return self.sums


class Weights:
    """Weights over the feature columns for `row(..., weights=)`: a vector (one linear model) or
    a (dim, k) matrix (k models, a column each); each hashed block's occurrences' weights come
    back summed, which is what a linear scorer needs."""

    def __init__(self, values: np.ndarray) -> None:
        v = np.asarray(values, dtype=np.float64)
        self.values = np.ascontiguousarray(v[:, None] if v.ndim == 1 else v)
        if self.values.ndim != 2:
            raise ValueError(f"weights must be a vector or a matrix, got shape {v.shape}")
        self.models = self.values.shape[1]
        self.address = self.values.ctypes.data


@dataclass(slots=True)
class _Compiled:
    spec: FeatureSpec
    vocabulary: frozenset[int]
    mean: np.ndarray
    scale: np.ndarray
    bounds: np.ndarray      # first column of the char and of the cross block
    dims: np.ndarray        # size of the word, char and cross block (uint64)
    starts: np.ndarray      # first column of each of the three blocks
    params: np.ndarray      # the C kernel's parameter block (native.params_of)
    norm: np.ndarray        # dense mean then scale, one array (the C kernel reads it)
    norm_at: int            # its address
    kernel: "native.Kernel | None"   # None: the numpy path


_COMPILED: dict[int, _Compiled] = {}


def compiled(spec: FeatureSpec) -> _Compiled:
    """The spec's lookup set and arrays, built once per spec object (specs are not mutated); the C
    kernel is loaded (built on first use) here, so a scorer's first request does not pay for it."""
    hit = _COMPILED.get(id(spec))
    if hit is None or hit.spec is not spec:
        if len(_COMPILED) > 64:
            _COMPILED.clear()
        base = spec.n_dense + spec.word_dim
        starts = (spec.n_dense, base, base + spec.char_dim)
        dims = (spec.word_dim, spec.char_dim, spec.cross_dim)
        params = native.params_of(spec.word_ngrams, spec.char_ngrams, dims, starts, spec.dim,
                                  (int(_SALT_WORD), int(_SALT_BIGRAM), int(_SALT_CHAR), int(_SALT_CROSS)),
                                  spec.cross_weight)
        mean = np.asarray(spec.dense_mean, dtype=np.float64)
        scale = np.asarray(spec.dense_scale, dtype=np.float64)
        norm = np.ascontiguousarray(np.concatenate([mean, scale]))
        kernel = native.load() if mean.size == scale.size == len(DENSE_NAMES) else None
        hit = _Compiled(spec, frozenset(spec.vocabulary), mean, scale,
                        np.array([base, base + spec.char_dim], dtype=np.int64),
                        np.array(dims, dtype=np.uint64), np.array(starts, dtype=np.int64), params, norm,
                        norm.ctypes.data, kernel)
        _COMPILED[id(spec)] = hit
    return hit


def _raw_dense(text: str, window: str, words: list[str], digits: int, numbers: int, longest: int,
               tokens: int, novelty: tuple[float, int]) -> list[float]:
    b = window.encode("utf-8", "surrogatepass")
    n = len(b)
    return [float(tokens), float(len(text)), float(len(words)), float(digits), float(numbers), float(longest),
            float(n - len(b.translate(None, _OPERATORS))), float(n - len(b.translate(None, _CAPITALS))),
            float(n - len(b.translate(None, _PUNCT))), float(len(set(words))),
            float(text.count("\n") + 1), float(b.count(b"?")), novelty[0], float(novelty[1])]


def _token_stats(toks: _Tokens) -> tuple[int, int, int]:
    """Digit characters, number tokens and the longest number's digits."""
    numbers = toks.lengths[toks.numeric]
    return toks.digits, int(numbers.size), int(numbers.max()) if numbers.size else 0


_CROSS_ALONE = 3        # the kind and the two novelty entries also stand alone in the cross block


def _cross_parts(ins: Instruction, kind: str, novelty: float, tokens: int,
                 hard: Sequence[str] = ()) -> tuple[list[int], list[int]]:
    """The cross block's left entries (instruction words, then the kind and the novelty) and its
    size signatures (and `hard`: payload_difficulty's signatures), as crc32 values."""
    sizes = [f"p{len(ins.tail.split())}", f"n{len(ins.numbers)}",
             f"d{max((len(n) for n in ins.numbers), default=0)}", *hard]
    if tokens >= 0:
        sizes.append(f"k{tokens // 4}")
    nov = 0 if novelty <= 0 else 1 if novelty <= 1 / 3 else 2 if novelty <= 2 / 3 else 3
    left = [_crc32(("w " + w).encode("utf-8", "surrogatepass")) for w in ins.words]
    left += [_crc("k " + kind), _crc(f"v {nov} {kind}"), _crc(f"v {nov}")]
    return left, [_crc32(("s " + z).encode()) for z in sizes]


def _size_tokens(tokens: int, spec: FeatureSpec) -> int:
    """The token count the size signatures read; -1 (none) for normalised features, whose sizes
    come from the input alone (the count moves with every word of wording around it)."""
    return -1 if spec.normalise else tokens


def _hard(text: str, spec: FeatureSpec) -> list[str]:
    """payload_difficulty's signatures of the prompt's window as written (version 4), else none."""
    return signatures(window_of(text, spec.window)) if spec.difficulty else []


def _cross_hashes(ins: Instruction, kind: str, novelty: float, tokens: int, hard: Sequence[str] = ()) -> np.ndarray:
    left_l, sizes = _cross_parts(ins, kind, novelty, tokens, hard)
    left, hs = np.array(left_l, dtype=np.uint64), np.array(sizes, dtype=np.uint64)
    # every instruction word, the kind and the novelty alone and crossed with each size; sizes alone
    return np.concatenate([(left[:, None] * _U(0x100000001) + hs[None, :]).ravel(), left[-_CROSS_ALONE:], hs])


def _text_parts(text: str, spec: FeatureSpec):
    c = compiled(spec)
    text = view(text, spec)
    window = window_of(text, spec.window)
    words = (window.lower() if spec.lowercase else window).split()
    ins = instruction(window)
    return c, window, words, " " + " ".join(words) + " ", ins, _novelty(ins, c.vocabulary)


def _factors(squares: Sequence[float], cross_weight: float) -> np.ndarray:
    """Per block: its weight / the L2 norm of its count vector (0 for an empty block)."""
    return np.array([w / math.sqrt(q) if q > 0 else 0.0 for w, q in zip((1.0, 1.0, cross_weight), squares)],
                    dtype=np.float64)


def row(text: str, tokens: int, spec: FeatureSpec, weights: Weights | None = None) -> Row:
    """The features of one prompt (see `Row`); `extract` and the scorer both read this. The hashed
    blocks come from the C kernel (tokenyard/router_models/runtime/native.py) when it is built, else from
    numpy (`row_numpy`); the two agree bit for bit (tests/router/test_router_native.py). With `weights`
    (of spec.dim columns), `Row.sums` holds each hashed block's sum of weights over its columns."""
    c = compiled(spec)
    if weights is not None and weights.values.shape[0] != spec.dim:
        raise ValueError(f"weights must have {spec.dim} columns (rows of the matrix), got {weights.values.shape[0]}")
    if c.kernel is None:
        return _with_sums(row_numpy(text, tokens, spec), weights)
    hard = _hard(text, spec)
    text = view(text, spec)
    window = window_of(text, spec.window)
    ins = instruction(window)
    novelty = _novelty(ins, c.vocabulary)
    left, sizes = _cross_parts(ins, _payload_kind(ins), novelty[0], _size_tokens(tokens, spec), hard)
    r = c.kernel.row(window.lower() if spec.lowercase else window, window, text, tokens, left, sizes,
                     _CROSS_ALONE, novelty, c.params, c.norm_at, None if weights is None else weights.address,
                     1 if weights is None else weights.models)
    return Row(r.dense, r.cols, r.ends, r.factors, r.sums)


def _with_sums(r: Row, weights: Weights | None) -> Row:
    if weights is not None:
        w = weights.values.take(r.cols, axis=0)
        e0, e1, e2 = r.ends
        r.sums = np.stack([w[:e0].sum(axis=0), w[e0:e1].sum(axis=0), w[e1:e2].sum(axis=0),
                           r.dense @ weights.values[: r.dense.size]])
    return r


def row_numpy(text: str, tokens: int, spec: FeatureSpec) -> Row:
    """`row` through numpy alone: the reference the C kernel is tested against, and its fallback."""
    c, window, words, padded, ins, novelty = _text_parts(text, spec)
    return _row_numpy(view(text, spec), tokens, spec, c, window, words, padded, ins, novelty, _hard(text, spec))


def _row_numpy(text: str, tokens: int, spec: FeatureSpec, c: _Compiled, window: str, words: list[str],
               padded: str, ins: Instruction, novelty: tuple[float, int], hard: Sequence[str] = ()) -> Row:
    cp = _codepoints(padded)
    toks = _tokens(cp)
    raw = np.array(_raw_dense(text, window, words, *_token_stats(toks), tokens, novelty), dtype=np.float64)
    dense = (np.log1p(raw) - c.mean) / c.scale
    lo, hi = spec.word_ngrams
    h = toks.hashes
    word_parts = [h] if lo <= 1 else []
    if hi >= 2 and h.size > 1:
        word_parts.append(h[:-1] * _U(_P) + h[1:] + _SALT_BIGRAM)
    word_h = (np.concatenate(word_parts) if len(word_parts) > 1 else word_parts[0] if word_parts else h[:0]) ^ _SALT_WORD
    char_h = (_char_hashes(cp, *spec.char_ngrams) if words else cp[:0]) ^ _SALT_CHAR
    cross_h = _cross_hashes(ins, _payload_kind(ins), novelty[0], _size_tokens(tokens, spec), hard) ^ _SALT_CROSS
    ends = (word_h.size, word_h.size + char_h.size, word_h.size + char_h.size + cross_h.size)
    # one multiply-shift for the three blocks, then each block's size and first column
    mixed = (np.concatenate([word_h, char_h, cross_h]) * _MIX) >> _SHIFT
    sizes = (ends[0], ends[1] - ends[0], ends[2] - ends[1])
    cols = (mixed % np.repeat(c.dims, sizes)).astype(np.int64) + np.repeat(c.starts, sizes)
    # L2 norm of each block's count vector, from one sort: runs of equal columns are counts.
    s = np.sort(cols)
    first = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    counts = np.diff(np.append(first, s.size))
    block = np.searchsorted(c.bounds, s[first], side="right")
    sq = np.bincount(block, weights=(counts * counts).astype(np.float64), minlength=3)
    return Row(dense, cols, ends, _factors(sq.tolist(), spec.cross_weight))


def raw_dense(text: str, tokens: int, spec: FeatureSpec) -> list[float]:
    """Dense counts in DENSE_NAMES order, before log1p and standardisation."""
    c, window, words, padded, ins, novelty = _text_parts(text, spec)
    return _raw_dense(view(text, spec), window, words, *_token_stats(_tokens(_codepoints(padded))), tokens, novelty)


def with_vocabulary(spec: FeatureSpec, texts: Sequence[str]) -> FeatureSpec:
    """A copy of spec whose novelty is measured against these (training) prompts' instructions."""
    from dataclasses import replace

    return replace(spec, vocabulary=vocabulary_of(texts, spec.window, spec.normalise))


def fit_normalisation(spec: FeatureSpec, texts: Sequence[str], tokens: Sequence[int]) -> FeatureSpec:
    """A copy of spec with the dense mean/scale of log1p counts over these (training) prompts."""
    from dataclasses import replace

    rows = np.log1p(np.array([raw_dense(t, n, spec) for t, n in zip(texts, tokens)], dtype=np.float64))
    mean = rows.mean(axis=0)
    scale = rows.std(axis=0)
    scale[scale < 1e-12] = 1.0
    return replace(spec, dense_mean=tuple(float(x) for x in mean), dense_scale=tuple(float(x) for x in scale))


def extract(text: str, tokens: int, spec: FeatureSpec) -> dict[int, float]:
    """One prompt's sparse feature row {column: value}."""
    r = row(text, tokens, spec)
    out = dict(enumerate(r.dense.tolist()))
    start = 0
    for end, factor in zip(r.ends, r.factors.tolist()):
        if end > start:
            uniq, counts = np.unique(r.cols[start:end], return_counts=True)
            out.update(zip(uniq.tolist(), (counts * factor).tolist()))
        start = end
    return out


def matrix(texts: Sequence[str], tokens: Sequence[int], spec: FeatureSpec):
    """Rows of `extract` as a scipy CSR matrix (training and batch evaluation)."""
    from scipy.sparse import csr_matrix

    indptr: list[int] = [0]
    indices: list[int] = []
    data: list[float] = []
    for text, n in zip(texts, tokens):
        r = extract(text, n, spec)
        cols = sorted(r)
        indices.extend(cols)
        data.extend(r[c] for c in cols)
        indptr.append(len(indices))
    return csr_matrix((np.array(data, dtype=np.float64), np.array(indices, dtype=np.int64),
                       np.array(indptr, dtype=np.int64)), shape=(len(indptr) - 1, spec.dim))
