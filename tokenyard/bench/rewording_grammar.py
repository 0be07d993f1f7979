"""A grammar of rephrasings for the demo task suite: the same input asked in wording that no
template of tokenyard/demo/task_suite.py (phrasings 0-5) uses, so no demo model, tokenizer,
router training or calibration ever saw it.

    text = reword(task_name, fields, family, rng, familiar=user_text)

Families (each a set of frames per task, filled from shared pools of verbs, lead-ins and tails,
so one item can come out in many wordings):
  embedded  the instruction inside a longer sentence, the input in the middle of it
  question  the request asked as a question
  terse     clipped keywords, lower case, typos in the instruction words (never in the input)
  reordered other verbs, the input first and the instruction after it
  context   the familiar wording itself, after an unrelated context sentence (and before one, half
            the time)

The input fields appear verbatim in every wording (a typo never touches them), so the answer and
the engines' outcomes of the familiar wording stay the right ones to score against.
"""
from __future__ import annotations

import random
import re

FAMILIES = ("embedded", "question", "terse", "reordered", "context")

# Verbs the suite's templates do not use, per task key (task name, or combo's kind).
_VERBS = {
    "copy": ("restate", "recite", "retype", "read back", "parrot back", "transcribe"),
    "upper": ("uppercase", "put in block capitals", "set in capital letters", "render in uppercase"),
    "reverse": ("invert", "mirror", "turn around", "read backwards"),
    "sort": ("line up from least to greatest", "put in rising order", "order ascending"),
    "count": ("tally up", "total up", "keep count of"),
    "add": ("total", "sum up", "add up"),
    "reverse_upper": ("invert and uppercase", "mirror and put in block capitals", "turn around and capitalise"),
    "add_twice": ("total", "sum up", "add up"),
    "lookup": ("say", "tell me", "let me know"),
}

# Frames per family and task key; {v} is a verb from _VERBS, the rest are the task's fields.
_FRAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "embedded": {
        "copy": ("{lead} {v} the words {words} exactly as they are {tail}",
                 "{lead} take the list {words} and {v} it word for word {tail}"),
        "upper": ("{lead} {v} the words {words} {tail}", "{lead} take {words} and {v} every word {tail}"),
        "reverse": ("{lead} take the words {words} and {v} their order {tail}",
                    "{lead} {v} the sequence {words} so the last word comes first {tail}"),
        "sort": ("{lead} take the numbers {nums} and {v} {tail}", "{lead} {v} the values {nums} {tail}"),
        "count": ("{lead} work out how many of the letters in {seq} are {letter} {tail}",
                  "{lead} look at {seq} and {v} the letter {letter} in it {tail}"),
        "add": ("{lead} {v} the numbers {a} and {b} {tail}", "{lead} take {a}, add {b} to it, and give the total {tail}"),
        "reverse_upper": ("{lead} take the words {words} and {v} them {tail}",
                          "{lead} {v} the sequence {words}, last word first, all in capitals {tail}"),
        "add_twice": ("{lead} {v} {a} and {b} and give that number twice over {tail}",
                      "{lead} take {a} plus {b} and state the total two times {tail}"),
        "lookup": ("{lead} {v} the city where {name} lives {tail}",
                   "{lead} find out the place {name} lives in and {v} it {tail}"),
    },
    "question": {
        "copy": ("Could you {v} {words} for me?", "Can you give me {words} back exactly as written?",
                 "Would you mind if I asked you to {v} {words}?"),
        "upper": ("Could you {v} {words}?", "What does {words} look like written in block capitals?",
                  "How would {words} look in uppercase?"),
        "reverse": ("What is {words} when read backwards word by word?", "Could you {v} the order of {words}?",
                    "What does the list {words} look like in reverse?"),
        "sort": ("What are {nums} in order from least to greatest?", "Could you {v} {nums}?",
                 "If you lined up {nums} from the smallest up, what would you get?"),
        "count": ("How many {letter}'s are there in {seq}?", "Could you {v} the {letter}'s in {seq}?",
                  "In {seq}, how many letters are {letter}?"),
        "add": ("How much is {a} plus {b}?", "Could you {v} {a} and {b}?", "What's the total when {b} is added to {a}?"),
        "reverse_upper": ("What is {words} backwards and in capitals?", "Could you {v} {words}?",
                          "How would {words} look in reverse order, all uppercase?"),
        "add_twice": ("What's {a} plus {b}, said twice?", "Could you {v} {a} and {b} and say it two times?",
                      "How much is {a} plus {b}? Could you give it twice?"),
        "lookup": ("Do you know which city {name} lives in?", "What city is home for {name}?",
                   "Could you {v} where {name} lives?"),
    },
    "terse": {
        "copy": ("{v} {words}", "same again pls {words}", "{words} - {v}"),
        "upper": ("caps {words}", "{v} pls {words}", "{words} -> uppercase"),
        "reverse": ("backwards {words}", "{v} order {words}", "{words} -> reverse"),
        "sort": ("sort asc {nums}", "{nums} -> ascending", "smallest first {nums}"),
        "count": ("count {letter} in {seq}", "{seq} -> how many {letter}", "num of {letter}s {seq}"),
        "add": ("{a} plus {b} =", "sum {a} {b}", "total {a} + {b} pls"),
        "reverse_upper": ("backwards + caps {words}", "{words} -> reverse, uppercase", "{v} {words}"),
        "add_twice": ("{a} plus {b}, twice", "sum {a} {b} x2", "total {a} + {b} two times pls"),
        "lookup": ("city of {name}?", "{name} lives where", "{name} home city pls"),
    },
    "reordered": {
        "copy": ("{words} - please {v} these words exactly.", "Here is a list, {words}, which you should {v}."),
        "upper": ("{words} - {v} all of that.", "Here are some words, {words}, to {v}."),
        "reverse": ("{words} - {v} the order of these.", "Here are some words, {words}; {v} their sequence."),
        "sort": ("{nums} - {v}, please.", "Here are some numbers, {nums}, to {v}."),
        "count": ("{seq} - {v} the {letter}'s in that.", "In the letters {seq}, {v} the letter {letter}."),
        "add": ("{a} and {b} - {v} these two.", "Starting from {a}, put {b} on top and report the total."),
        "reverse_upper": ("{words} - {v} these.", "Here are some words, {words}; {v} them."),
        "add_twice": ("{a} and {b} - {v} them and state the result twice.",
                      "Starting from {a}, put {b} on top and report the total two times."),
        "lookup": ("{name} - {v} which city that person lives in.", "Regarding {name}: {v} the city they live in."),
    },
}

_LEADS = ("I need you to", "For my notes, please", "My teacher wants me to ask someone to",
          "When you have a moment, could you", "It would help a lot if you could", "I was hoping you would")
_TAILS = ("for me.", "and nothing else.", "so I can check my work.", "- thanks.", "if that's all right.",
          "before lunch.")
_CONTEXT_BEFORE = ("I'm preparing a short quiz for a class.", "This is part of a small test I'm running.",
                   "Quick one before my meeting.", "My colleague and I disagree about this one.",
                   "I've been stuck on this for a while.", "Here is something for a worksheet.")
_CONTEXT_AFTER = ("Thanks in advance!", "No need to explain the steps.", "Hope your day is going well.",
                  "I'll double-check it later.", "Much appreciated.", "It's for a puzzle night.")

_FIELD = re.compile(r"\{(\w+)\}")
_TYPO_RATE = 0.5     # share of instruction words (4+ letters) given one typo in the terse family


def task_key(task: str, fields: dict[str, str]) -> str:
    """The grammar's key: combo's kind (its two kinds ask different things), else the task name."""
    return fields.get("kind") or task


def _typo(word: str, rng: random.Random) -> str:
    # one edit inside the word (first letter kept, so it still reads as the word): drop, swap, double
    i = rng.randrange(1, len(word) - 1)
    edit = rng.randrange(3)
    if edit == 0:
        return word[:i] + word[i + 1:]
    if edit == 1:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    return word[:i] + word[i] + word[i:]


def _typos(literal: str, rng: random.Random) -> str:
    return re.sub(r"[A-Za-z]{4,}", lambda m: _typo(m.group(0), rng) if rng.random() < _TYPO_RATE else m.group(0),
                  literal)


def _fill(frame: str, values: dict[str, str], rng: random.Random, typos: bool) -> str:
    """The frame with its slots filled; typos go into the frame's own words only, never the values."""
    parts = _FIELD.split(frame)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(values[part])
        else:
            out.append(_typos(part, rng) if typos else part)
    return "".join(out)


def reword(task: str, fields: dict[str, str], family: str, rng: random.Random, familiar: str = "") -> str:
    """One wording of this input in `family` (the context family wraps `familiar`, the item's own
    familiar user text). ValueError for an unknown family or task."""
    if family not in FAMILIES:
        raise ValueError(f"unknown wording family {family!r}; known: {', '.join(FAMILIES)}")
    if family == "context":
        if not familiar:
            raise ValueError("the context family needs the familiar wording")
        # Always a sentence before: with one after only, a template whose input ends the message
        # would read the context as part of the input (and parse it as its own wording).
        parts = [rng.choice(_CONTEXT_BEFORE), familiar]
        if rng.random() < 0.5:
            parts.append(rng.choice(_CONTEXT_AFTER))
        return " ".join(parts)
    key = task_key(task, fields)
    if key not in _VERBS:
        raise ValueError(f"no rephrasings for task {key!r}")
    frame = rng.choice(_FRAMES[family][key])
    verb = rng.choice(_VERBS[key])
    lead, tail = rng.choice(_LEADS), rng.choice(_TAILS)
    # the verb, lead and tail are the frame's words: typos may hit them, never the input fields
    frame = frame.replace("{v}", verb).replace("{lead}", lead).replace("{tail}", tail)
    text = _fill(frame, fields, rng, typos=family == "terse")
    return text
