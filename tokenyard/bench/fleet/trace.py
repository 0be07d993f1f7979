"""The request trace the fleet simulator replays: a diurnal arrival rate with spikes, seeded.

The rate follows one day (`period_s`, 86,400 s by default): `night_rps` at t = 0, rising as a raised
cosine to `peak_rps` at half the period and back. On top, `spikes` bursts at seeded random times
multiply the rate by `spike_factor` for `spike_s` seconds each (a launch, a viral post, a retry
storm: the load an autoscaler with minutes of lead time cannot follow). Arrivals are a
non-homogeneous Poisson process drawn by thinning; each request has a prompt and an output
length drawn uniformly from their ranges. The same config and seed give the same trace.

    trace = make_trace(TraceConfig(period_s=3600, night_rps=1, peak_rps=6, spikes=2, seed=0))
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class TraceConfig:
    period_s: float = 86_400.0          # one day
    night_rps: float = 1.0              # arrival rate at t = 0 (the trough)
    peak_rps: float = 8.0               # arrival rate at period_s / 2 (the diurnal peak, spikes aside)
    spikes: int = 3                     # bursts over the trace
    spike_factor: float = 3.0           # the rate multiplies by this during a burst
    spike_s: float = 600.0              # how long a burst lasts
    prompt_tokens: tuple[int, int] = (32, 256)    # uniform range of prompt lengths
    output_tokens: tuple[int, int] = (16, 64)     # uniform range of output lengths
    seed: int = 0

    def __post_init__(self) -> None:
        if self.period_s <= 0 or self.night_rps < 0 or self.peak_rps < self.night_rps or self.peak_rps <= 0:
            raise ValueError("trace: need period_s > 0 and 0 <= night_rps <= peak_rps, peak_rps > 0")
        if self.spikes < 0 or self.spike_factor < 1 or self.spike_s < 0:
            raise ValueError("trace: need spikes >= 0, spike_factor >= 1, spike_s >= 0")
        for name in ("prompt_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"trace: {name} must be a range 1 <= lo <= hi, got {(lo, hi)}")


@dataclass(slots=True, frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class Trace:
    config: TraceConfig
    requests: list[Request]
    spike_starts: list[float]           # when each burst begins (seconds)

    def rate_at(self, t: float) -> float:
        return rate_at(self.config, self.spike_starts, t)

    def window_peak_rps(self, window_s: float = 60.0) -> float:
        """The most arrivals in any `window_s` window (sliding over arrivals), per second: what a
        capacity planner looking at past traffic calls the peak."""
        times = [r.arrival_s for r in self.requests]
        best, lo = 0, 0
        for hi, t in enumerate(times):
            while times[lo] < t - window_s:
                lo += 1
            best = max(best, hi - lo + 1)
        return best / window_s

    def mean_rps(self) -> float:
        return len(self.requests) / self.config.period_s


def rate_at(cfg: TraceConfig, spike_starts: list[float], t: float) -> float:
    """The arrival rate (requests/s) at time t."""
    day = cfg.night_rps + (cfg.peak_rps - cfg.night_rps) * 0.5 * (1 - math.cos(2 * math.pi * t / cfg.period_s))
    in_spike = any(s <= t < s + cfg.spike_s for s in spike_starts)
    return day * (cfg.spike_factor if in_spike else 1.0)


def make_trace(cfg: TraceConfig) -> Trace:
    rng = np.random.default_rng(cfg.seed)
    # Bursts anywhere but the last spike_s of the day, in time order.
    spike_starts = sorted(float(s) for s in rng.uniform(0, max(cfg.period_s - cfg.spike_s, 0.0), cfg.spikes))
    bound = cfg.peak_rps * cfg.spike_factor          # no rate in the trace is higher: thinning envelope
    requests: list[Request] = []
    t = 0.0
    # Draw in chunks (far faster than one draw per candidate); thinning keeps each candidate
    # with probability rate(t) / bound.
    chunk = 4096
    while True:
        gaps = rng.exponential(1.0 / bound, chunk)
        keep = rng.uniform(0, bound, chunk)
        prompts = rng.integers(cfg.prompt_tokens[0], cfg.prompt_tokens[1] + 1, chunk)
        outputs = rng.integers(cfg.output_tokens[0], cfg.output_tokens[1] + 1, chunk)
        for gap, u, p, o in zip(gaps, keep, prompts, outputs):
            t += float(gap)
            if t >= cfg.period_s:
                return Trace(cfg, requests, spike_starts)
            if u < rate_at(cfg, spike_starts, t):
                requests.append(Request(len(requests), t, int(p), int(o)))
