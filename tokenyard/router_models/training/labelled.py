"""A labelled prompt set for router training: prompts, token counts, 0/1 labels (1: the small engine is
enough) and, when known, each engine's outcome per prompt. Its own module so that the training pieces
(train.py, augment.py, traffic_labels.py, ...) share it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

LABEL_DESIGNS = ("small_enough", "expected_gain")


@dataclass(slots=True)
class Labelled:
    texts: list[str]
    tokens: list[int]
    labels: np.ndarray                          # 1: small is enough
    small_correct: np.ndarray | None = None     # per engine: correct (bool), or a quality in [0, 1]
    large_correct: np.ndarray | None = None
    meta: list[dict[str, Any]] = field(default_factory=list)   # task/level/phrasing when known

    def __len__(self) -> int:
        return len(self.texts)

    def subset(self, mask: np.ndarray) -> "Labelled":
        idx = np.nonzero(mask)[0] if np.asarray(mask).dtype == bool else np.asarray(mask, dtype=np.int64)

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[idx]
        return Labelled([self.texts[i] for i in idx], [self.tokens[i] for i in idx], self.labels[idx],
                        pick(self.small_correct), pick(self.large_correct),
                        [self.meta[i] for i in idx] if self.meta else [])

    def targets(self, design: str) -> np.ndarray:
        """The fitting target per prompt, in [0, 1], for a label design (see the module doc)."""
        if design not in LABEL_DESIGNS:
            raise ValueError(f"unknown label design {design!r}; known: {', '.join(LABEL_DESIGNS)}")
        if self.small_correct is None or self.large_correct is None:
            if design == "small_enough":
                return self.labels.astype(np.float64)
            raise ValueError("the expected_gain target needs both engines' outcomes per prompt; use "
                             "labels='small_enough' for files with a 0/1 label only")
        gain = self.large_correct.astype(np.float64) - self.small_correct.astype(np.float64)
        if design == "small_enough":        # 1 - max(0, gain): the 0/1 label for right/wrong outcomes
            return 1.0 - np.clip(gain, 0.0, 1.0)
        return (1.0 - gain) / 2.0


def concat(a: Labelled, b: Labelled) -> Labelled:
    def cat(x: np.ndarray | None, y: np.ndarray | None) -> np.ndarray | None:
        return None if x is None or y is None else np.concatenate([x, y])
    meta = a.meta + b.meta if a.meta and b.meta else []
    return Labelled(a.texts + b.texts, a.tokens + b.tokens, np.concatenate([a.labels, b.labels]),
                    cat(a.small_correct, b.small_correct), cat(a.large_correct, b.large_correct), meta)
