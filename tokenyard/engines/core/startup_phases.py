"""Where a replica's start-up time goes: seconds per phase, from process start to ready.

A new replica is useless until it is ready, and the autoscaler's lead time is that start-up; to
cut it one has to know what it is made of. The engine times its own phases while it is built
(`Engine.startup_phases`); `tokenyard engine serve` adds the time before the engine was built
(interpreter start, imports, deployment file: "imports") and after (engine start, server bind:
"warm_up"), and "other" is what no phase covers, so the phases sum to the measured total.

    phases = StartupPhases()
    with phases.phase("weights_read"):
        with phases.phase("quantise_pack"):   # nested: its time is not counted twice
            ...
    phases.finish(total_s)                    # adds "other" = total - the phases

Logged at start and exported as `tokenyard_engine_startup_seconds{engine,phase}`.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

log = logging.getLogger(__name__)

# In the order they happen; "other": what no phase covers (config, scheduler, tokenizer, ...).
PHASES = ("imports", "weights_read", "quantise_pack", "kv_allocation", "compile", "warm_up", "other")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc, 10 ms resolution); None elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])       # field 22 of stat(5), counted after "pid (comm)"
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupPhases:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = {}
        self.total_s: float | None = None
        self._stack: list[list[float]] = []   # per open phase: [start, seconds of the phases nested in it]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown start-up phase {name!r} (known: {', '.join(PHASES)})")
        frame = [self._clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            spent = self._clock() - frame[0]
            self.add(name, spent - frame[1])
            if self._stack:
                self._stack[-1][1] += spent

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def merge(self, other: dict[str, float]) -> None:
        """Another part's phases (the engine's, inside the process's); its "other" stays other."""
        for name, s in other.items():
            self.add(name, s)

    def finish(self, total_s: float) -> dict[str, float]:
        """Close at `total_s` measured seconds: "other" takes what the phases leave."""
        covered = sum(s for n, s in self.seconds.items() if n != "other")
        self.seconds["other"] = max(0.0, total_s - covered)
        self.total_s = total_s
        return self.as_dict()

    def as_dict(self) -> dict[str, float]:
        return {n: self.seconds[n] for n in PHASES if n in self.seconds}

    def describe(self) -> str:
        parts = ", ".join(f"{n} {s:.2f}" for n, s in self.as_dict().items())
        total = f"{self.total_s:.2f} s" if self.total_s is not None else "(open)"
        return f"{total}: {parts}"
