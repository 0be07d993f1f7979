"""A prompt's layout-free form for the router (feature version 3, `FeatureSpec.normalise`).

    canonical("Write in capital letters: frog dog cup gold")  ->  "writ capital letter : frog dog cup gold"
    canonical("frog dog cup gold - put them in capitals")       ->  "put capital : frog dog cup gold"

Version 2 features read the last line as "instruction: payload" (split at its last colon) and
hash what is written, case, punctuation and line breaks included; a request that puts its input
inside a sentence, asks a question, or adds a sentence of context moves most of them (issue 51).
This rewrites the prompt's end into one line, "instruction words : payload", before the features
are computed, whatever the layout was:

  payload      every number; in a sentence without numbers, the longest run of >= MIN_RUN plain
               tokens (words or single letters, no stop word, no name, no punctuation between
               them); read in the sentence that holds the most (numbers count three times), in
               their order: the input a task works on, wherever it sits. (A noun right before a
               word list, as in "the words lamp tree", joins the run: no grammar is parsed.)
  instruction  the other words of that sentence, lower case, stop words dropped, one English
               suffix stripped (STEM_SUFFIXES), names kept capitalised (the features mask them);
               with fewer than MIN_INSTRUCTION words, the sentence before it is read too (not
               across a line break, which parts chat messages, unless this one has no word);
               sentences elsewhere (greetings, context) are left out.

features.view then drops instruction words the training prompts never used (they have no trained
weight, only dilute the rest), after trying to repair one typo (two letters swapped, one too many).

The stop words and suffixes are generic English written for this file (no task's or benchmark's
wording). Pure and cheap: one regex pass, a class letter per token (cached in a dict) and regexes
over that string of letters (~10 us for a demo prompt, ~23 us for a full 256-character window of
prose on a loaded 2-core machine); the C
and the numpy feature paths both read its output, so they stay equal.
"""
from __future__ import annotations

import re

MIN_RUN = 2                 # plain tokens in a row that make a payload run
MIN_INSTRUCTION = 2         # fewer instruction words: the sentence before is read too
STOP_WORDS = frozenset("""
a an the this these that those it its they them their there here i me my we us our you your
is are was were be been being am do does did done have has had will would shall should can could
may might must please kindly just also so very really quite some any thing things one ones
of to for on at by with from as into onto about than in out up down over under off through
and or but nor not if then else when while where what which who whom whose why how
all each every both either neither more most less least only own same such other another
hi hello hey thanks thank ok okay oh well yes no
""".split())
# Longest first; a word keeps at least 3 letters.
STEM_SUFFIXES = ("ations", "ation", "ings", "ing", "ised", "ized", "ises", "izes", "ise", "ize", "edly",
                 "ness", "ed", "ly", "ies", "es", "s", "e")
# words, numbers, sentence ends ('.', '!', '?' runs; each line break), any other visible character
_PIECE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+|[.!?]+|\n|[^\sA-Za-z\d.!?]")
_SENTENCE = re.compile(r"[^en]+")
_RUN = re.compile(r"p+")
_OPERATORS = frozenset("+*/=<>^%")      # a dash is prose punctuation as often as a minus
# per token, cached (the same few hundred words recur): its class in a payload run ("p" plain,
# "c" capitalised: plain first in a sentence, else a name; "x" neither) and its instruction form
_CLASS: dict[str, str] = {}
_FORM: dict[str, str] = {}
_CACHE_LIMIT = 1 << 16


def stem(word: str) -> str:
    """`word` (lower case) without its first matching suffix, keeping 3 letters or more."""
    for suffix in STEM_SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)]
    return word


def _class(piece: str) -> str:
    c = _CLASS.get(piece)
    if c is None:
        if len(_CLASS) > _CACHE_LIMIT:
            _CLASS.clear()
        if piece == "\n":
            c = "n"                     # a line break: ends a sentence, parts chat messages
        elif piece[0] in ".!?":
            c = "e"                     # ends a sentence
        elif not piece.isalpha():
            c = "d" if piece.isdigit() else "x"
        elif len(piece) == 1:
            c = "p"                     # single letters are data ("a b c"), even "a" and "I"
        elif piece.lower() in STOP_WORDS:
            c = "x"
        elif piece[0].isupper() and piece[1:].islower():
            c = "c"
        else:
            c = "p"
        _CLASS[piece] = c
    return c


def _form(piece: str) -> str:
    """A token's instruction form: "" (left out), the name as written, or its lower-case stem."""
    f = _FORM.get(piece)
    if f is None:
        if len(_FORM) > _CACHE_LIMIT:
            _FORM.clear()
        if piece.isalpha():
            low = piece.lower()
            f = "" if low in STOP_WORDS else piece if len(piece) > 1 and piece[0].isupper() and \
                piece[1:].islower() else stem(low)
        else:
            f = piece if piece in _OPERATORS else ""
        _FORM[piece] = f
    return f


def _payload(classes: str) -> tuple[range | list[int], int]:
    """Positions in a sentence (given its token classes) of its payload (its numbers; without
    numbers, its longest plain run of >= MIN_RUN), and its weight when choosing the sentence
    (numbers count three times)."""
    if "d" in classes:
        at = [i for i, c in enumerate(classes) if c == "d"]
        return at, 3 * len(at)
    if classes[:1] == "c":
        classes = "p" + classes[1:]     # a capital first in its sentence is no name
    best = range(0)
    for m in _RUN.finditer(classes.replace("c", "x")):
        if m.end() - m.start() >= len(best):     # the last of equal runs (inputs end requests)
            best = range(m.start(), m.end())
    return (best, len(best)) if len(best) >= MIN_RUN else ([], 0)


def _instruction_words(sentence: list[str], skip: range | list[int]) -> list[str]:
    skipped = set(skip)
    known = _FORM.get
    words = [f if (f := known(p)) is not None else _form(p) for i, p in enumerate(sentence) if i not in skipped]
    if sentence and 0 not in skipped and sentence[0][:1].isupper() and words and words[0] == sentence[0]:
        words[0] = stem(sentence[0].lower())    # first in its sentence: a capital, not a name
        if words[0] in STOP_WORDS:
            words[0] = ""
    return [w for w in words if w]


def canonical(window: str) -> str:
    """The layout-free form of a prompt's end: "instruction words : payload" on one line."""
    pieces = _PIECE.findall(window)
    known = _CLASS.get                  # a dict hit without a call: this is most of the cost
    classes = "".join([known(p) or _class(p) for p in pieces])
    spans = [m.span() for m in _SENTENCE.finditer(classes)]
    if not spans:
        return ""
    found = [_payload(classes[a:b]) for a, b in spans]
    # the sentence with the most payload tokens; the last one among equals (requests end prompts)
    k = max(range(len(spans)), key=lambda i: (found[i][1], i))
    a, b = spans[k]
    at = found[k][0]
    words = _instruction_words(pieces[a:b], at)
    # a line break between the two sentences parts chat messages: read the one before only when
    # this one has no instruction word at all
    if len(words) < MIN_INSTRUCTION and k > 0 and (not words or "n" not in classes[spans[k - 1][1]:a]):
        pa, pb = spans[k - 1]
        words = _instruction_words(pieces[pa:pb], found[k - 1][0]) + words
    payload = [pieces[a + i] for i in at]
    return " ".join(words) + " : " + " ".join(payload) if payload else " ".join(words)
