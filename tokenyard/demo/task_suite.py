"""Demo task suite: short chat prompts with checkable answers over four difficulty levels.

Two tiny Llama models are trained from scratch on the train split (a few million tokens on a
CPU), the large one should beat the small one on the harder levels, and a router later learns
when the small one is good enough. So every task is learnable by a model of a few million
parameters, prompt + answer stay far under 100 BPE tokens, and difficulty grows with what
capacity buys: longer inputs, more digits, more facts to memorise.

Splits are disjoint by construction. For computed tasks the canonical input is hashed into a
bucket that belongs to exactly one split, and draws from another split's bucket are redrawn, so
an evaluated input was never trained on, in any wording. `lookup` answers are memorised facts
(the model cannot compute them), so there every fact is trained with two of phrasings 0-2 and
evaluated with the third and with the held-out phrasing. Phrasing 3 never appears in train.

Phrasings 4 and 5 (ROUTER_TEST_PHRASINGS) are wording that no split of the suite ever draws: the
demo models, their tokenizer and the router's training and calibration never see it. The router's
test split alone uses it (tokenyard/demo/router_labels.py re-words its phrasing-3 items with `rephrase`), so
the router is measured on wording that is new to everything.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterable, Sequence

LEVELS = (1, 2, 3, 4)
HELD_OUT_PHRASING = 3
SPLITS = ("train", "validation", "test")
TRAIN_PHRASINGS = (0, 1, 2)
ALL_PHRASINGS = (0, 1, 2, 3)
# Never drawn by generate_items: only the router's test split re-words items with these.
ROUTER_TEST_PHRASINGS = (4, 5)
# Out of 10 input buckets: 8 train, 1 validation, 1 test (computed tasks).
_BUCKET_SPLIT = ("train",) * 8 + ("validation", "test")
# A cell whose split owns no input at all is a bug in the level table; fail loudly, not slowly.
_MAX_DRAWS = 10_000
# Short system prompts; "" means the item has no system message.
SYSTEM_PROMPTS = ("", "Answer with the result only.", "Be brief.")

# Common short words: each is likely one BPE token, so tasks test the operation, not spelling.
WORDS = tuple("""
apple bread chair dog egg fish goat hat ink jam kite lamp moon nest owl pen
rain sun tree cup van wolf box ant bell cake door fox gold hill ice jar
key leaf milk nut oak pig ring salt toy vase wind star frog corn desk ship
road bird coat drum farm game horn lake map note park rose sock tent wall yard
""".split())
CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Rome", "Delhi", "Tokyo", "Dublin", "Quito",
          "Seoul", "Berlin", "Madrid", "Vienna", "Athens", "Hanoi", "Nairobi", "Lisbon",
          "Prague", "Warsaw", "Havana", "Manila", "Dakar", "Sydney", "Boston")
COUNT_LETTERS = ("a", "b", "c")
FACT_SEED = 4
FACT_COUNT = 400

# Level tables: the one place difficulty is defined.
COPY_LENGTHS = {1: 3, 2: 5, 3: 8, 4: 12}
REVERSE_LENGTHS = {1: 3, 2: 4, 3: 6, 4: 8}
UPPER_SIZES = {1: (16, 2), 2: (32, 3), 3: (48, 4), 4: (64, 6)}   # (word pool, words)
COMBO_SIZES = {1: (16, 2), 2: (32, 3), 3: (48, 4), 4: (64, 5)}
COUNT_LENGTHS = {1: 4, 2: 6, 3: 9, 4: 12}
SORT_SIZES = {1: (3, 10), 2: (4, 100), 3: (5, 100), 4: (6, 1000)}  # (numbers, below)
LOOKUP_FACTS = {1: 20, 2: 60, 3: 150, 4: 400}                     # first N facts of the table

Fields = dict[str, str]
Generator = Callable[[random.Random, int], tuple[Fields, str]]
Checker = Callable[[str, str], bool]

_EDGE = r"[\s.,!?;:'\"`]+"
_EDGES = re.compile(rf"^{_EDGE}|{_EDGE}$")


def normalize_reply(text: str) -> str:
    """Strip surrounding whitespace/punctuation and collapse inner whitespace; nothing else."""
    return " ".join(_EDGES.sub("", text).split())


def check_reply(reply: str, answer: str) -> bool:
    """Exact, case-sensitive match after normalisation.

    Numbers need no special rule: "42." normalises to "42" while "421" and "4 2" stay wrong.
    Case counts everywhere, so `upper` rejects lower case and the other tasks stay canonical.
    """
    return normalize_reply(reply) == normalize_reply(answer)


@dataclass(slots=True, frozen=True)
class TaskItem:
    task: str
    level: int
    phrasing: int
    messages: tuple[dict[str, str], ...]
    answer: str
    split: str

    @property
    def user_text(self) -> str:
        return self.messages[-1]["content"]

    def check(self, reply: str) -> bool:
        return get_task(self.task).checker(reply, self.answer)

    def to_dict(self) -> dict:
        return {"task": self.task, "level": self.level, "phrasing": self.phrasing,
                "messages": [dict(m) for m in self.messages], "answer": self.answer,
                "split": self.split}

    @classmethod
    def from_dict(cls, data: dict) -> TaskItem:
        get_task(data["task"])  # fail at load time, not at the first check()
        return cls(task=data["task"], level=int(data["level"]), phrasing=int(data["phrasing"]),
                   messages=tuple({"role": m["role"], "content": m["content"]}
                                  for m in data["messages"]),
                   answer=data["answer"], split=data["split"])


@dataclass(slots=True, frozen=True)
class Task:
    """One task: a generator of (fields, answer), phrasings per kind, and a checker.

    `templates` maps a kind ("" for single-kind tasks, else fields["kind"]) to its phrasings;
    the phrasing index means the same thing for every kind: 0-2 train, HELD_OUT_PHRASING (3)
    evaluation only, ROUTER_TEST_PHRASINGS (4, 5) the router's test split only.
    """
    name: str
    generate: Generator
    templates: dict[str, tuple[str, ...]]
    checker: Checker = check_reply
    memorised: bool = False  # answers come from the fact table, not from the input

    def render(self, fields: Fields, phrasing: int) -> str:
        return self.templates[fields.get("kind", "")][phrasing].format(**fields)

    def parse(self, text: str, phrasing: int) -> Fields:
        """The fields (with "kind" for multi-kind tasks) that `render(fields, phrasing)` turns into
        this text; ValueError when no template of that phrasing renders it."""
        for kind, templates in self.templates.items():
            parts = re.split(r"\{(\w+)\}", templates[phrasing])
            pattern = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>.+?)" for i, p in enumerate(parts))
            m = re.fullmatch(pattern, text)
            if m:
                return {**({"kind": kind} if kind else {}), **m.groupdict()}
        raise ValueError(f"{self.name}: phrasing {phrasing} does not render {text!r}")


@lru_cache(maxsize=1)
def _facts() -> tuple[tuple[str, str], ...]:
    # Made-up three-syllable names (CVCVCV): a few BPE tokens each, not real words, so a model
    # can only know a person's city by memorising it.
    rng = random.Random(FACT_SEED)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    names: list[str] = []
    seen: set[str] = set()
    while len(names) < FACT_COUNT:
        name = "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(3)).title()
        if name not in seen:
            seen.add(name)
            names.append(name)
    return tuple((name, rng.choice(CITIES)) for name in names)


def fact_table() -> list[tuple[str, str]]:
    """The (person, city) facts behind `lookup`, identical on every call and machine."""
    return list(_facts())


def _words(rng: random.Random, pool: int, k: int) -> list[str]:
    # Distinct words keep answers unambiguous (a swap of two words is always a real error).
    return rng.sample(WORDS[:pool], k)


def _operands(rng: random.Random, level: int) -> tuple[int, int]:
    low = 0 if level == 1 else 10 ** (level - 1)
    return rng.randint(low, 10 ** level - 1), rng.randint(low, 10 ** level - 1)


def _gen_copy(rng: random.Random, level: int) -> tuple[Fields, str]:
    words = " ".join(_words(rng, len(WORDS), COPY_LENGTHS[level]))
    return {"words": words}, words


def _gen_upper(rng: random.Random, level: int) -> tuple[Fields, str]:
    words = " ".join(_words(rng, *UPPER_SIZES[level]))
    return {"words": words}, words.upper()


def _gen_count(rng: random.Random, level: int) -> tuple[Fields, str]:
    # Letters are spaced out: inside a BPE token a letter is invisible to a tiny model.
    seq = rng.choices(COUNT_LETTERS, k=COUNT_LENGTHS[level])
    letter = rng.choice(COUNT_LETTERS)
    return {"letter": letter, "seq": " ".join(seq)}, str(seq.count(letter))


def _gen_reverse(rng: random.Random, level: int) -> tuple[Fields, str]:
    words = _words(rng, len(WORDS), REVERSE_LENGTHS[level])
    return {"words": " ".join(words)}, " ".join(reversed(words))


def _gen_sort(rng: random.Random, level: int) -> tuple[Fields, str]:
    count, below = SORT_SIZES[level]
    nums = rng.sample(range(below), count)
    return {"nums": " ".join(map(str, nums))}, " ".join(map(str, sorted(nums)))


def _gen_lookup(rng: random.Random, level: int) -> tuple[Fields, str]:
    name, city = _facts()[rng.randrange(LOOKUP_FACTS[level])]
    return {"name": name}, city


def _gen_add(rng: random.Random, level: int) -> tuple[Fields, str]:
    a, b = _operands(rng, level)
    return {"a": str(a), "b": str(b)}, str(a + b)


def _gen_combo(rng: random.Random, level: int) -> tuple[Fields, str]:
    if rng.random() < 0.5:
        words = _words(rng, *COMBO_SIZES[level])
        return ({"kind": "reverse_upper", "words": " ".join(words)},
                " ".join(reversed(words)).upper())
    a, b = _operands(rng, level)
    return {"kind": "add_twice", "a": str(a), "b": str(b)}, f"{a + b} {a + b}"


# Inputs always end the message after a colon (or sit inline for add/lookup) so the wording
# around them is the only thing phrasings change. Index 3 of each tuple is held out; 4 and 5 are
# the router's test wording (never drawn by generate_items).
_TASK_LIST = (
    Task("copy", _gen_copy, {"": (
        "Repeat these words: {words}",
        "Copy the list exactly: {words}",
        "Write these words again: {words}",
        "Say back the words: {words}",
        "Echo this list unchanged: {words}",
        "Reproduce the following sequence exactly: {words}")}),
    Task("upper", _gen_upper, {"": (
        "Write in capital letters: {words}",
        "Convert to upper case: {words}",
        "Make these words upper case: {words}",
        "Turn into capitals: {words}",
        "Capitalise every letter of: {words}",
        "Give this text in all caps: {words}")}),
    Task("count", _gen_count, {"": (
        "Count the letter {letter} in: {seq}",
        "How many times does the letter {letter} appear in: {seq}",
        "Give the number of times the letter {letter} occurs in: {seq}",
        "How often is the letter {letter} in: {seq}",
        "Tally each {letter} in this sequence: {seq}",
        "Report how frequently {letter} shows up in: {seq}")}),
    Task("reverse", _gen_reverse, {"": (
        "Reverse the order of these words: {words}",
        "Write these words in reverse order: {words}",
        "Put these words backwards: {words}",
        "Give the words from last to first: {words}",
        "Flip the order of this list: {words}",
        "List these from the end to the start: {words}")}),
    Task("sort", _gen_sort, {"": (
        "Sort these numbers from smallest to largest: {nums}",
        "Put these numbers in ascending order: {nums}",
        "Order from low to high: {nums}",
        "Arrange in increasing order: {nums}",
        "Rank these values, lowest first: {nums}",
        "Rearrange so that each value exceeds the previous one: {nums}")}),
    Task("lookup", _gen_lookup, {"": (
        "Where does {name} live?",
        "Which city is {name} from?",
        "In which city does {name} live?",
        "Name the home city of {name}.",
        "Tell me the town {name} calls home.",
        "{name} resides in what city?")}, memorised=True),
    Task("add", _gen_add, {"": (
        "What is {a} + {b}?",
        "Add {a} and {b}.",
        "Compute the sum of {a} and {b}.",
        "What do you get if you add {a} to {b}?",
        "Find the total of {a} plus {b}.",
        "{a} and {b} added together make how much?")}),
    Task("combo", _gen_combo, {
        "reverse_upper": (
            "Reverse these words and write them in capitals: {words}",
            "Write these words in reverse order and in upper case: {words}",
            "Put these words backwards, then make them upper case: {words}",
            "Give the words from last to first in capital letters: {words}",
            "Flip the order of this list and capitalise it: {words}",
            "List these from the end to the start in all caps: {words}"),
        "add_twice": (
            "What is {a} + {b}? Write the answer two times.",
            "Add {a} and {b}, then write the result two times.",
            "Compute the sum of {a} and {b} and write it two times.",
            "Add {a} to {b} and say the result two times.",
            "Find the total of {a} plus {b} and repeat it twice.",
            "Sum {a} with {b}, then state that result twice.")}),
)
_TASKS = {task.name: task for task in _TASK_LIST}
TASKS: tuple[str, ...] = tuple(_TASKS)


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None


def rephrase(item: TaskItem, phrasing: int) -> TaskItem:
    """The same input asked in another phrasing (system message, answer and split kept)."""
    task = get_task(item.task)
    fields = task.parse(item.user_text, item.phrasing)
    messages = item.messages[:-1] + ({"role": "user", "content": task.render(fields, phrasing)},)
    return TaskItem(item.task, item.level, phrasing, messages, item.answer, item.split)


def _hash(text: str) -> int:
    # blake2b, not hash(): stable across processes and PYTHONHASHSEED.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _input_key(task: Task, fields: Fields) -> str:
    # Level is left out on purpose: an input shared by two levels (lookup's first facts) must
    # still land in one split only.
    return task.name + "|" + "|".join(f"{k}={fields[k]}" for k in sorted(fields))


def split_of(task: Task, fields: Fields, phrasing: int) -> str:
    """The one split that owns this (input, phrasing)."""
    key = _input_key(task, fields)
    if not task.memorised:
        return _BUCKET_SPLIT[_hash(key) % len(_BUCKET_SPLIT)]
    # Every fact is trained, with two of phrasings 0-2; the third and the held-out phrasing
    # of that fact are evaluated (validation or test by hash).
    if phrasing != HELD_OUT_PHRASING and phrasing != _hash(key) % len(TRAIN_PHRASINGS):
        return "train"
    return ("validation", "test")[_hash(f"{key}#{phrasing}") % 2]


def _draw_item(task: Task, level: int, split: str, rng: random.Random) -> TaskItem:
    phrasings = TRAIN_PHRASINGS if split == "train" else ALL_PHRASINGS
    for _ in range(_MAX_DRAWS):
        fields, answer = task.generate(rng, level)
        phrasing = rng.choice(phrasings)
        if split_of(task, fields, phrasing) == split:
            break
    else:
        raise RuntimeError(f"{task.name} level {level}: no input owned by split {split!r}")
    system = rng.choice(SYSTEM_PROMPTS)
    messages = ({"role": "system", "content": system},) if system else ()
    messages += ({"role": "user", "content": task.render(fields, phrasing)},)
    return TaskItem(task.name, level, phrasing, messages, answer, split)


def _seed(*parts: object) -> int:
    return _hash(repr(parts))


def generate_items(split: str, n: int, seed: int = 0, tasks: Sequence[str] | None = None,
                   levels: Sequence[int] | None = None) -> list[TaskItem]:
    """n items, deterministic in (split, n, seed), uniform over tasks x levels.

    Items come in rounds that visit every (task, level) cell once in a shuffled order, so
    counts differ by at most one and a shorter list is a prefix of a longer one. Each cell has
    its own random stream, so restricting `tasks`/`levels` does not change a cell's items.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError("n must be >= 0")
    task_names = tuple(TASKS if tasks is None else tasks)
    level_list = tuple(LEVELS if levels is None else levels)
    for level in level_list:
        if level not in LEVELS:
            raise ValueError(f"unknown level {level!r}; known: {LEVELS}")
    cells = [(get_task(name), level) for name in task_names for level in level_list]
    if n and not cells:
        raise ValueError("no tasks or no levels to draw from")
    order_rng = random.Random(_seed("order", split, seed))
    cell_rngs = {(task.name, level): random.Random(_seed(split, seed, task.name, level))
                 for task, level in cells}
    items: list[TaskItem] = []
    while len(items) < n:
        round_cells = list(cells)
        order_rng.shuffle(round_cells)
        for task, level in round_cells[: n - len(items)]:
            items.append(_draw_item(task, level, split, cell_rngs[(task.name, level)]))
    return items


def corpus_texts(n: int, seed: int = 0) -> list[str]:
    """Texts to train the BPE tokenizer on: train-split messages and answers, plus the facts.

    Train only, so held-out wording is as new to the tokenizer as it is to the model.
    """
    texts = ["\n".join([*(m["content"] for m in item.messages), item.answer])
             for item in generate_items("train", n, seed)]
    texts.extend(f"{name}: {city}" for name, city in _facts())
    return texts


def to_jsonl(items: Iterable[TaskItem], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")


def from_jsonl(path: str | Path) -> list[TaskItem]:
    items = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                items.append(TaskItem.from_dict(json.loads(line)))
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: bad task item: {exc}") from exc
    return items
