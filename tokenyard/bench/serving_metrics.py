"""Serving metrics from per-request records, in the shape of vLLM's benchmark_serving.

Definitions (per request, from the client's clock):
- TTFT: request sent -> first chunk that carries output text.
- ITL: the gaps between consecutive text-bearing chunks of one request. A chunk may carry more
  than one token (speculative decoding, a detokeniser holding back a partial character), so ITL
  is per chunk, exactly as a user sees it.
- TPOT: (E2E - TTFT) / (output_tokens - 1). The first token is excluded because its time is
  TTFT, which is reported apart; a request with a single output token has no TPOT.
- E2E: request sent -> the response is complete.
Output token counts come from the server's usage (not from counting chunks), so TPOT stays
right when chunks carry several tokens.

Aggregates: mean, median, p99 (and any other percentiles asked for) of each; request and output
token throughput over the benchmark's wall time; goodput = requests per second that completed
and met every stated SLO (TTFT <= x, TPOT <= y, E2E <= z; an SLO left as None is not checked).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence


@dataclass(slots=True)
class RequestRecord:
    """What the load generator saw for one request. Times are seconds."""

    ok: bool = False
    status: int = 0                      # HTTP status (0: never got one: connect error, timeout)
    error: str = ""
    start: float = 0.0                   # perf_counter at send, relative to the run's start
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    model: str = ""                      # the engine that served (response `model`)
    tag: str = ""                        # the dataset's label for this request (task, class, ...)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two output tokens."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class SLO:
    """Service-level objectives for goodput, in milliseconds; None means not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = (("ttft", self.ttft_ms, r.ttft), ("tpot", self.tpot_ms, r.tpot), ("e2e", self.e2e_ms, r.e2e))
        for name, limit_ms, value in checks:
            if limit_ms is None:
                continue
            if value is None:
                # One output token has no TPOT, so it cannot break a TPOT objective.
                if name == "tpot":
                    continue
                return False
            if value * 1e3 > limit_ms:
                return False
        return True

    def describe(self) -> str:
        parts = [f"{name} <= {v:g} ms" for name, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms),
                                                          ("E2E", self.e2e_ms)) if v is not None]
        return " and ".join(parts) or "none"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default), so results match numpy.percentile; NaN for no values."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(slots=True)
class Distribution:
    """Summary of one latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[str, float]        # "p99" -> value
    count: int

    @classmethod
    def of(cls, seconds: Sequence[float], quantiles: Sequence[float] = (99,)) -> "Distribution":
        ms = [s * 1e3 for s in seconds]
        if not ms:
            return cls(math.nan, math.nan, math.nan, {_pname(q): math.nan for q in quantiles}, 0)
        mean = sum(ms) / len(ms)
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms))
        return cls(mean, percentile(ms, 50), std, {_pname(q): percentile(ms, q) for q in quantiles}, len(ms))


def _pname(q: float) -> str:
    return f"p{q:g}"


@dataclass(slots=True)
class Summary:
    """One benchmark run: counts, throughputs and latency distributions."""

    duration_s: float
    completed: int
    failed: int
    total_prompt_tokens: int
    total_cached_tokens: int
    total_output_tokens: int
    request_throughput: float            # completed requests / s
    output_throughput: float             # output tokens / s
    total_token_throughput: float        # (prompt + output) tokens / s
    goodput: float | None                # requests / s meeting every SLO (None: no SLO stated)
    slo: str
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors: dict[str, int]               # error text (or status) -> count

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO | None = None,
              quantiles: Sequence[float] = (99,)) -> Summary:
    """Aggregate a run. Failed requests count in `failed` and `errors` only, never in latencies."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"{r.status}: {r.error[:120]}" if r.status else r.error[:120] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    goodput = None if slo is None else sum(slo.met_by(r) for r in ok) / duration_s
    return Summary(
        duration_s=duration_s, completed=len(ok), failed=len(records) - len(ok),
        total_prompt_tokens=prompt_tokens, total_cached_tokens=sum(r.cached_tokens for r in ok),
        total_output_tokens=out_tokens, request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s, total_token_throughput=(out_tokens + prompt_tokens) / duration_s,
        goodput=goodput, slo=slo.describe() if slo else "none",
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None], quantiles),
        tpot=Distribution.of([t for r in ok if (t := r.tpot) is not None], quantiles),
        itl=Distribution.of([g for r in ok for g in r.itls], quantiles),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None], quantiles),
        errors=errors,
    )


def format_summary(name: str, s: Summary) -> str:
    """A human-readable block like benchmark_serving's printout."""
    lines = [f"==== {name} ====",
             f"completed / failed:             {s.completed} / {s.failed}",
             f"duration (s):                   {s.duration_s:.2f}",
             f"request throughput (req/s):     {s.request_throughput:.2f}",
             f"output token throughput (tok/s): {s.output_throughput:.1f}",
             f"total token throughput (tok/s): {s.total_token_throughput:.1f}"]
    if s.goodput is not None:
        lines.append(f"goodput (req/s, {s.slo}): {s.goodput:.2f}")
    for label, d in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        pct = "  ".join(f"{k} {v:.1f}" for k, v in d.percentiles.items())
        lines.append(f"{label:5s} ms: mean {d.mean:.1f}  median {d.median:.1f}  {pct}")
    for err, n in s.errors.items():
        lines.append(f"error x{n}: {err}")
    return "\n".join(lines)
