"""Training-time perturbations: copies of the labelled prompts in wording the router did not see.

    more = augment(train, copies=2, seed=0)      # 2 perturbed copies of each prompt, same outcomes
    train_router(train, cal, augment_copies=2)   # what `tokenyard router train` does (train.DEFAULT_AUGMENT)

A perturbed copy keeps its prompt's label and outcomes (the engines were judged on the original):
it teaches the router that the same request in another form needs the same engine. Each copy gets
one to three of these edits, drawn at random (a seeded `random.Random`):

  typo      one or two instruction words get a character swapped, dropped or doubled
  drop      one instruction word dropped
  swap      two neighbouring instruction words swapped
  filler    a neutral sentence from FILLERS before the prompt, after it, or both
  move      the input first, the instruction after it (joined by one of MOVE_JOINS)
  wrap      the instruction asked through one of WRAPPERS ("could you ... ?"), input inline
  inline    the colon dropped: instruction and input in one run, a TRAILERS clause after
  flat      all lower case, punctuation removed
  bare      the instruction cut to one of its words, or to nothing (the input alone)

Only the last line (the user's request) is edited. The input (what follows the last colon, or,
with none, every number and capitalised name) is never edited. The pools are short, generic,
written for this file, and independent of tokenyard/bench/rewording_grammar.py, the benchmark of
new wording (which training must never see): no task verb is swapped for a synonym here (the
instruction keeps its own words, only misspelt, dropped, swapped or moved), no frame of that
grammar is used, and tests/router/test_router_augment.py checks that no sentence of these pools
occurs in it.

Token counts of a copy are estimated from the original's: its count plus the change in characters
times the training set's tokens per character (no tokenizer needed; they only feed the dense
length feature).
"""
from __future__ import annotations

import random
import re
from typing import Callable

import numpy as np

from tokenyard.router_models.training.labelled import Labelled

FILLERS = (
    "The weather is nice today.", "I keep notes in a paper diary.", "Our office moved last spring.",
    "The printer is out of ink again.", "My tea went cold.", "We are testing a new tool.",
    "Keep it short.", "Ignore the earlier message.", "The train was late this morning.",
    "I am on my phone right now.", "This goes into a report.", "Ask again if anything is unclear.",
    "Another request follows.", "Good morning!", "Appreciate the help.",
)
MOVE_JOINS = (" - ", ". ", "\n", " -> ", ", ", " ... ")
WRAPPERS = ("Could you {}?", "Can you {}?", "Would you {} please?", "Your task: {}.", "Please {}.",
            "Task for you - {}.", "Are you able to {}?")
TRAILERS = ("for me", "if you can", "right away", "when you get a chance", "quickly", "please", "thanks")
EDITS = ("typo", "drop", "swap", "filler", "move", "wrap", "inline", "flat", "bare")
_WORD = re.compile(r"[A-Za-z]{4,}")


def _split(user: str) -> tuple[str, str]:
    """(instruction, input) at the last colon; with none, the whole message is the instruction."""
    if ":" in user:
        head, tail = user.rsplit(":", 1)
        return head.strip(), tail.strip()
    return user.strip(), ""


def _protected(text: str) -> set[str]:
    """Words an edit must not touch in a message without a colon: numbers and names."""
    toks = text.split()
    return {t for i, t in enumerate(toks) if any(ch.isdigit() for ch in t) or (i > 0 and t[:1].isupper())}


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == 1:
        return word[:i] + word[i + 1:]
    return word[:i] + word[i] + word[i:]


def _edit_words(head: str, rng: random.Random, edit: str, keep: set[str]) -> str:
    words = head.split()
    idx = [i for i, w in enumerate(words) if w not in keep and _WORD.fullmatch(w.strip(".,?!"))
           and not w[:1].isupper() or i == 0 and w not in keep and _WORD.fullmatch(w.strip(".,?!"))]
    if not idx:
        return head
    if edit == "typo":
        for i in rng.sample(idx, min(len(idx), rng.choice((1, 2)))):
            words[i] = _typo(words[i], rng)
    elif edit == "drop" and len(words) > 2:
        del words[rng.choice(idx)]
    elif edit == "swap":
        pairs = [i for i in idx if i + 1 in idx]
        if pairs:
            i = rng.choice(pairs)
            words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[:2] != text[:2].upper() else text


def perturb(user: str, rng: random.Random) -> str:
    """One perturbed form of a user message (see the module doc)."""
    edits = rng.sample(EDITS, rng.choice((1, 2, 2, 3)))
    head, tail = _split(user)
    keep = _protected(user) if not tail else set()
    for e in ("typo", "drop", "swap"):
        if e in edits:
            head = _edit_words(head, rng, e, keep)
    if "bare" in edits and tail:
        head = rng.choice(["", rng.choice(head.split() or [""])])
    if tail and "move" in edits:
        text = tail + rng.choice(MOVE_JOINS) + _lower_first(head.rstrip(".?!"))
    elif "wrap" in edits:
        body = _lower_first(head.rstrip(".?!")) + (" " + tail if tail else "")
        text = rng.choice(WRAPPERS).format(body)
    elif tail and "inline" in edits:
        text = head + " " + tail + " " + rng.choice(TRAILERS)
    else:
        text = head + (": " + tail if tail else "")
    if "flat" in edits:
        text = re.sub(r"[^\w\s]", "", text).lower() if not keep else text.lower()
    if "filler" in edits:
        where = rng.randrange(3)
        if where in (0, 2):
            text = rng.choice(FILLERS) + " " + text
        if where in (1, 2):
            text = text + " " + rng.choice(FILLERS)
    return text


def augment(data: Labelled, copies: int = 2, seed: int = 0,
            last_message: Callable[[str], tuple[str, str]] | None = None) -> Labelled:
    """`copies` perturbed copies of every prompt (labels and outcomes kept), in one Labelled.

    The prompt is split into what precedes its last line (kept: system messages) and its last
    line (the request, perturbed); `last_message` may split it otherwise."""
    rng = random.Random(seed)
    per_char = sum(data.tokens) / max(1, sum(len(t) for t in data.texts))
    texts, tokens, idx = [], [], []
    for i, (text, n) in enumerate(zip(data.texts, data.tokens)):
        before, user = last_message(text) if last_message else _last_line(text)
        for _ in range(copies):
            new = before + perturb(user, rng)
            texts.append(new)
            tokens.append(max(1, int(round(n + (len(new) - len(text)) * per_char))))
            idx.append(i)
    sub = data.subset(np.array(idx, dtype=np.int64))
    sub.texts, sub.tokens = texts, tokens
    return sub


def _last_line(text: str) -> tuple[str, str]:
    before, sep, last = text.rpartition("\n")
    return before + sep, last
