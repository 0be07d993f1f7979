"""How hard a request's input is, read from the input alone (feature version 4, `FeatureSpec.difficulty`).

    signatures("Count the letter b in: a b b c")                      ->  ["c2", "c2/4"]
    signatures("In the letters a b b c, how many are b? Thanks.")    ->  ["c2", "c2/4"]

The size features (features.py) tell a router how long an input is; for some requests the size is
not what makes them hard. Counting a letter in a sequence is the case the demo suite measures:
with the task and the sequence's length known, whether demo-small answers still depends on the
answer itself (what a count of 0 or of 7 asks of a tiny model differs): a model told the true task,
level, system prompt and the parsed input reaches APGR 0.913, CPT(95%) 29.7% on the familiar test
prompts, and 0.883 / 34.8% without the count task's input features
(bench/results/router_difficulty_bound.json).

The count is read without any wording: the sequence is the longest run of three or more single
letters separated by single spaces; the letter asked about is a single letter outside it (alone,
or as "x's", or as "xs" when x occurs in the sequence), the nearest one to the run, where "a" and
"i" standing alone (an article, a pronoun) are taken only when no other letter is there. No run or
no such letter: no signature. Pure and cheap: two regex passes over the window (a few us).
"""
from __future__ import annotations

import re

MIN_SEQUENCE = 3            # single letters in a row that make a sequence to count in
MAX_COUNT = 16              # counts above this read as this (the signatures stay few)
_RUN = re.compile(r"(?<![A-Za-z'])[A-Za-z](?: [A-Za-z])+(?![A-Za-z'])")
_LETTER = re.compile(r"(?<![A-Za-z'])([A-Za-z])('s|s)?(?![A-Za-z'])")
_WEAK = frozenset("ai")     # "a" and "I" alone are words as often as letters


def letter_count(window: str) -> tuple[int, int] | None:
    """(occurrences of the letter asked about, length of the sequence), or None."""
    best = None
    for m in _RUN.finditer(window):
        n = (m.end() - m.start() + 1) // 2
        if n >= MIN_SEQUENCE and (best is None or n >= best[2]):
            best = (m.start(), m.end(), n)
    if best is None:
        return None
    start, end, n = best
    seq = window[start:end].lower().split()
    letters = set(seq)
    chosen = None                      # (weak, distance, letter): the smallest wins
    for m in _LETTER.finditer(window):
        if start <= m.start() < end:
            continue
        letter, suffix = m.group(1).lower(), m.group(2)
        if suffix == "s" and letter not in letters:
            continue                   # "as", "is": words, unless the sequence has that letter
        weak = suffix is None and letter in _WEAK
        distance = start - m.end() if m.end() <= start else m.start() - end
        key = (weak, distance, letter)
        if chosen is None or key < chosen:
            chosen = key
    if chosen is None:
        return None
    return min(seq.count(chosen[2]), MAX_COUNT), n


def signatures(window: str) -> list[str]:
    """The difficulty signatures the cross block pairs with the instruction words and the kind."""
    found = letter_count(window)
    if found is None:
        return []
    count, n = found
    return [f"c{count}", f"c{count}/{min(n, 4 * MAX_COUNT)}"]
