"""Operator label files for `tokenyard router train --labels FILE`: one judged answer per line.

    {"prompt": "Summarise this contract: ...", "engine": "small-8b", "good": true}
    {"prompt": "Summarise this contract: ...", "engine": "large-70b", "score": 0.9}
    {"messages": [{"role": "user", "content": "Translate ..."}], "engine": "small-8b", "good": false,
     "prompt_tokens": 41}

Each line is a JSON object with
  prompt or messages  the request (messages are joined as the gateway scores them: their
                      contents, newline-separated)
  engine              the engine that answered (a name from the deployment)
  good or score       the judgement: true/false, or a quality in [0, 1] (exactly one of the two)
  prompt_tokens       optional: the serving tokenizer's count (else counted with --tokenizer)
Blank lines are skipped. Anything else is refused with the file, the line number and the reason.

Per prompt (lines with the same prompt text), each engine's quality is the mean of its
judgements. The two-engine router needs the small engine's quality: a prompt judged on both
engines gives both; a prompt judged on the small engine only assumes the large engine is good
(1.0: a bad small answer means the large engine is needed); a prompt judged on the large engine
only says nothing about the small one and is left out (counted in the summary), as are lines for
other engines.
"""
from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenyard.router_models.runtime.features import prompt_text
from tokenyard.router_models.training.train import Labelled

KEYS = {"prompt", "messages", "engine", "good", "score", "prompt_tokens"}


@dataclass(slots=True)
class Judgement:
    prompt: str
    engine: str
    quality: float
    prompt_tokens: int | None
    line: int


@dataclass(slots=True)
class Summary:
    lines: int = 0
    prompts: int = 0
    both_engines: int = 0
    small_only: int = 0
    large_only_skipped: int = 0
    other_engine_lines: int = 0
    engines: dict[str, int] = field(default_factory=dict)


def _refuse(path: Path, line: int, reason: str) -> ValueError:
    return ValueError(f"{path}:{line}: {reason}")


def parse_line(text: str, path: Path, line: int) -> Judgement:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _refuse(path, line, f"not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(obj, dict):
        raise _refuse(path, line, f"expected a JSON object, got {type(obj).__name__}")
    extra = set(obj) - KEYS
    if extra:
        raise _refuse(path, line, f"unknown keys {', '.join(sorted(extra))} (known: {', '.join(sorted(KEYS))})")
    if ("prompt" in obj) == ("messages" in obj):
        raise _refuse(path, line, "give the request as exactly one of prompt (text) and messages (a list)")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise _refuse(path, line, "prompt must be non-empty text")
    else:
        messages = obj["messages"]
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)):
            raise _refuse(path, line, "messages must be a non-empty list of objects with text content")
        prompt = prompt_text(messages)
    engine = obj.get("engine")
    if not isinstance(engine, str) or not engine:
        raise _refuse(path, line, "engine must be a non-empty engine name")
    if ("good" in obj) == ("score" in obj):
        raise _refuse(path, line, "give exactly one of good (true/false) and score (a number in [0, 1])")
    if "good" in obj:
        if not isinstance(obj["good"], bool):
            raise _refuse(path, line, f"good must be true or false, got {obj['good']!r}")
        quality = float(obj["good"])
    else:
        score = obj["score"]
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score) \
                or not 0 <= score <= 1:
            raise _refuse(path, line, f"score must be a number in [0, 1], got {score!r}")
        quality = float(score)
    tokens = obj.get("prompt_tokens")
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
        raise _refuse(path, line, f"prompt_tokens must be a whole number >= 0, got {tokens!r}")
    return Judgement(prompt, engine, quality, tokens, line)


def read_judgements(path: str | Path) -> list[Judgement]:
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if text.strip():
                out.append(parse_line(text, path, number))
    if not out:
        raise ValueError(f"{path}: no judgements (one JSON object per line)")
    return out


def to_labelled(judgements: list[Judgement], small: str, large: str, path: str | Path = "labels",
                count_tokens=None) -> tuple[Labelled, Summary]:
    """Per-prompt small and large qualities (see the module doc). `count_tokens(text)` counts
    prompts whose lines carry no prompt_tokens (None: such prompts are refused)."""
    if small == large:
        raise ValueError("the small and the large engine must differ")
    summary = Summary(lines=len(judgements))
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    tokens: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for j in judgements:
        summary.engines[j.engine] = summary.engines.get(j.engine, 0) + 1
        if j.engine not in (small, large):
            summary.other_engine_lines += 1
            continue
        per[j.prompt][j.engine].append(j.quality)
        first_line.setdefault(j.prompt, j.line)
        if j.prompt_tokens is not None:
            tokens.setdefault(j.prompt, j.prompt_tokens)
    if not per:
        raise ValueError(f"{path}: no line names engine {small!r} or {large!r} (engines in the file: "
                         f"{', '.join(sorted(summary.engines))}); set --small and --large")
    texts, counts, qs, ql = [], [], [], []
    for prompt, by_engine in per.items():
        if small not in by_engine:
            summary.large_only_skipped += 1
            continue
        if prompt not in tokens:
            if count_tokens is None:
                raise ValueError(f"{path}:{first_line[prompt]}: prompt_tokens missing and no tokenizer to count it")
            tokens[prompt] = int(count_tokens(prompt))
        texts.append(prompt)
        counts.append(tokens[prompt])
        qs.append(float(np.mean(by_engine[small])))
        if large in by_engine:
            ql.append(float(np.mean(by_engine[large])))
            summary.both_engines += 1
        else:
            ql.append(1.0)
            summary.small_only += 1
    summary.prompts = len(texts)
    if not texts:
        raise ValueError(f"{path}: no prompt has a judgement of the small engine {small!r}")
    small_q, large_q = np.array(qs), np.array(ql)
    labels = (small_q >= large_q).astype(np.int64)
    return Labelled(texts, counts, labels, small_q, large_q), summary


def summary_dict(s: Summary) -> dict[str, Any]:
    return {"lines": s.lines, "prompts": s.prompts, "both_engines": s.both_engines, "small_only": s.small_only,
            "large_only_skipped": s.large_only_skipped, "other_engine_lines": s.other_engine_lines,
            "engines": dict(sorted(s.engines.items()))}
