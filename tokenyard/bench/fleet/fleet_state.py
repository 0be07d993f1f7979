"""What the fleet simulator tracks: replicas (with their life cycle and its cost), the sequences they
run, and the outcome of each request. The event loop that moves them is simulator.py.

A replica's life: `starting` (a cold start: process start to ready) or `waking` (from the warm
pool) -> `ready` (takes requests) -> `draining` (scaled down: takes none, finishes what it runs)
-> `asleep` (back to the warm pool) or `gone`. Every state but `gone` is paid for: `asleep` at
the simulator's `sleep_cost_share` of a replica (a level-1 sleeping replica still holds its
accelerator; a level-2 one may not), the others in full.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenyard.bench.fleet.trace import Request

STATES = ("starting", "waking", "ready", "draining", "asleep", "gone")
ACTIVE = ("starting", "waking", "ready")       # counted against the policy's target


@dataclass(slots=True)
class Seq:
    """One request on a replica."""

    req: Request
    dispatch_s: float                   # handed to the replica
    prefilled: int = 0                  # prompt tokens computed
    generated: int = 0                  # output tokens emitted
    first_token_s: float | None = None

    @property
    def context(self) -> int:
        return self.prefilled + self.generated

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.req.prompt_tokens


@dataclass(slots=True)
class Plan:
    """The step (or run of identical decode steps) a replica is computing."""

    start_s: float
    end_s: float
    steps: int                          # steps planned (1 when prompt chunks are computed)
    chunks: list[tuple[Seq, int]]       # prefill chunks of a single step
    decode: list[Seq]                   # sequences decoding in these steps
    first_step_s: float = 0.0           # a run of pure decode steps: its first step's seconds (> 0); else 0
    growth_s: float = 0.0               # a decode run: how much longer each next step is (context grows)

    def elapsed_for(self, steps: int) -> float:
        """Seconds that the first `steps` steps of this plan take."""
        if self.first_step_s <= 0.0:          # a single step with prompt chunks: its own time
            return self.end_s - self.start_s
        return steps * self.first_step_s + self.growth_s * steps * (steps - 1) / 2


@dataclass(slots=True)
class Replica:
    id: int
    state: str
    since_s: float                      # when it entered `state`
    ready_at_s: float = 0.0             # starting / waking: when it becomes ready
    to_pool: bool = False               # starting / draining: goes to the warm pool, not to serve / away
    seqs: list[Seq] = field(default_factory=list)
    plan: Plan | None = None
    epoch: int = 0                      # bumps when the replica's scheduled step event is superseded
    busy_s: float = 0.0                 # seconds spent in steps (utilisation = its rate)
    kicked: bool = False                # idle, with a step start scheduled at this instant

    @property
    def active(self) -> bool:
        """Counted against the policy's target (a replica starting for the warm pool is not)."""
        return self.state in ACTIVE and not self.to_pool

    def move(self, state: str, now: float, seconds: dict[str, float], end_s: float = float("inf")) -> None:
        """Change state, adding the time spent in the old one within [0, end_s] to `seconds` (the
        cost integral)."""
        spent = min(now, end_s) - min(self.since_s, end_s)
        seconds[self.state] = seconds.get(self.state, 0.0) + max(0.0, spent)
        self.state, self.since_s = state, now


@dataclass(slots=True)
class Outcome:
    """What happened to one request."""

    req: Request
    status: str = "pending"             # served | shed_queue_full | shed_predicted_wait | expired | unfinished
    ttft_s: float | None = None
    itl_s: float | None = None          # mean inter-token gap after the first token (None: one token)
    e2e_s: float | None = None
