"""How long one engine step takes, as a function of what the step holds: the fleet simulator's
service curve, measured from the real engine and fitted to a linear model.

One step of the engine (continuous batching, chunked prefill) computes one token for each
decoding sequence and a chunk of prompt tokens for each prefilling one. Its time is modelled as

    step_s = base_s + per_seq_s * decode_rows + per_ctx_token_s * decode_context_tokens
                    + [prefill_tokens > 0] * prefill_base_s + per_prefill_token_s * prefill_tokens

(decode_context_tokens: the sum of the decoding sequences' lengths, which the attention reads).
A step with prompt tokens pays `prefill_base_s` once more: on a CPU small decode batches run in one
C call while prefill takes the eager torch path, whose fixed cost is much higher.

That prefill cost is not a straight line on this engine (SmolLM2 int4 on a CPU: a 64-token prompt
took about as long as a 128-token one, and in the real-fleet check's replicas a 462-token step cost
1.5 ms a token where 38-142-token steps cost 2.5-4.4: bench/RESULTS.md, issue 52's real-fleet
sections). A curve may therefore carry `prefill_table`, the measured seconds of pure prefill steps
by prompt tokens; when it does, a step's prefill part is read off it (piecewise linear between its
points, the first point's cost below it, the last two points' slope above them, in proportion to a
single point) instead of `prefill_base_s + per_prefill_token_s x tokens`, which stay fitted and
reported.

A mixed step (decoding rows and prompt tokens at once) is not the sum of its parts here either: on a CPU
the C decode step takes pure decode steps only, so a mixed step runs its decoding rows through the eager
torch path beside the prompt, which costs a fixed ~30 ms more and ~2 ms a row (SmolLM2, one thread: a
128-token prompt with 1-12 decoding rows took 1.05-1.14x what `base_s + per_seq_s x rows + ...` plus
the prompt's prefill gave). Where timed mixed steps are at hand (`with_mixed`), the curve carries
`mixed_base_s` and `mixed_per_seq_s`, and a mixed step costs `base_s + prefill + mixed_base_s +
mixed_per_seq_s x rows + per_ctx_token_s x context` instead.
The coefficients come from a least-squares fit over timed steps of the real engine: pure decode
steps over a grid of batch sizes and context lengths, and pure prefill steps over a range of
chunk sizes. The fit's relative error on the measured points is kept with the curve so a reader
can judge it. Start-up figures (cold start, wake) are inputs of the fleet, not of the curve:
see `FleetTimes` in simulator.py.

    python -m tokenyard.bench.fleet.service_curve [--engine smollm2-135m] [--quick]
        -> bench/results/fleet_service_curve.json (RunRecorder), read by `tokenyard bench fleet`
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
CURVE_PATH = ROOT / "bench" / "results" / "fleet_service_curve.json"
# The fleet's replicas run this many sequences at once (the validation's real replicas too): small
# enough that a replica fills and the gateway's queue, the shedding and the scaling rule matter.
REPLICA_MAX_NUM_SEQS = 16


@dataclass(slots=True)
class ServiceCurve:
    """Step time model of one replica (seconds), and the engine limits that shape its batches."""

    base_s: float                       # fixed cost of a step (scheduling, sampling, Python)
    per_seq_s: float                    # each decoding sequence
    per_ctx_token_s: float              # each context token the decoding sequences attend over
    per_prefill_token_s: float          # each prompt token computed in the step
    prefill_base_s: float = 0.0         # once per step that computes any prompt tokens
    max_num_seqs: int = 128             # sequences one step may hold (the engine's max_num_seqs)
    max_num_batched_tokens: int = 512   # token budget of one step (chunked prefill)
    source: str = "hand-written"        # what it was measured on
    fit_error: dict[str, float] = field(default_factory=dict)   # relative error of the fit on its points
    # [[prompt tokens, seconds of a pure prefill step], ...]: when given, a step's prefill part comes
    # from it (prefill_seconds), not from prefill_base_s and per_prefill_token_s.
    prefill_table: list[list[float]] = field(default_factory=list)
    # A mixed step's decoding rows, where measured (with_mixed): once per mixed step, and per row in
    # place of per_seq_s. None: a mixed step is the sum of its decode and prefill parts.
    mixed_base_s: float | None = None
    mixed_per_seq_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("base_s", "per_seq_s", "per_ctx_token_s", "per_prefill_token_s", "prefill_base_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"service curve: {name} must be >= 0, got {getattr(self, name)}")
        points: list[list[float]] = []
        for point in self.prefill_table:
            if len(point) != 2 or not point[0] >= 1 or not point[1] >= 0:
                raise ValueError(f"service curve: prefill_table points are [tokens >= 1, seconds >= 0], got {point!r}")
            points.append([float(point[0]), float(point[1])])
        points.sort()
        if any(a[0] == b[0] for a, b in zip(points, points[1:])):
            raise ValueError("service curve: prefill_table has two points for the same number of tokens")
        # A longer prompt never costs less: a dip between two measured points is noise, not the engine.
        for a, b in zip(points, points[1:]):
            b[1] = max(a[1], b[1])
        self.prefill_table = points
        if (self.mixed_base_s is None) != (self.mixed_per_seq_s is None):
            raise ValueError("service curve: give mixed_base_s and mixed_per_seq_s together, or neither")
        for name in ("mixed_base_s", "mixed_per_seq_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"service curve: {name} must be >= 0, got {value}")
        if self.base_s + self.per_seq_s + self.per_ctx_token_s <= 0:
            raise ValueError("service curve: a decode step must take some time (base_s, per_seq_s or per_ctx_token_s > 0)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("service curve: max_num_seqs and max_num_batched_tokens must be >= 1")

    def step_s(self, decode_rows: int, decode_ctx: int, prefill_tokens: int) -> float:
        """Seconds of one step with `decode_rows` decoding sequences over `decode_ctx` context
        tokens in all, and `prefill_tokens` prompt tokens."""
        prefill = self.prefill_seconds(prefill_tokens) if prefill_tokens > 0 else 0.0
        if prefill_tokens > 0 and decode_rows > 0 and self.mixed_base_s is not None:
            assert self.mixed_per_seq_s is not None
            rows = self.mixed_base_s + self.mixed_per_seq_s * decode_rows
        else:
            rows = self.per_seq_s * decode_rows
        return self.base_s + rows + self.per_ctx_token_s * decode_ctx + prefill

    def prefill_seconds(self, tokens: int) -> float:
        """What `tokens` prompt tokens add to a step: from prefill_table where there is one (its step
        times less the step's fixed base_s), else prefill_base_s + per_prefill_token_s x tokens."""
        table = self.prefill_table
        if not table:
            return self.prefill_base_s + self.per_prefill_token_s * tokens
        if tokens <= table[0][0] or len(table) == 1:
            pure = table[0][1] if tokens <= table[0][0] else table[0][1] * tokens / table[0][0]
        else:
            i = next((k for k in range(1, len(table)) if tokens <= table[k][0]), len(table) - 1)
            (t0, s0), (t1, s1) = table[i - 1], table[i]
            pure = s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        return max(0.0, pure - self.base_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ServiceCurve":
        known = {"base_s", "per_seq_s", "per_ctx_token_s", "per_prefill_token_s", "prefill_base_s", "max_num_seqs",
                 "max_num_batched_tokens", "source", "fit_error", "prefill_table", "mixed_base_s", "mixed_per_seq_s"}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def load(cls, path: Path = CURVE_PATH) -> "ServiceCurve":
        """The curve from a results file (its figures.curve) or a bare curve JSON."""
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"service curve {path}: {e}") from None
        return cls.from_dict(doc.get("figures", {}).get("curve", doc))


@dataclass(slots=True)
class StepSample:
    """One timed step shape: its median seconds over repeats."""

    decode_rows: int
    decode_ctx: int
    prefill_tokens: int
    seconds: float


def fit(samples: list[StepSample], max_num_seqs: int, max_num_batched_tokens: int, source: str) -> ServiceCurve:
    """Least squares of the step model over the samples, coefficients clipped at zero (a negative
    cost is noise), with the fit's mean and worst relative error on those samples."""
    x = np.array([[1.0, s.decode_rows, s.decode_ctx, float(s.prefill_tokens > 0), s.prefill_tokens]
                  for s in samples])
    y = np.array([s.seconds for s in samples])
    # Weight by 1/y: relative error matters (a 1 ms step and a 50 ms step count alike).
    w = 1.0 / np.maximum(y, 1e-6)
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    pred = x @ coef
    rel = np.abs(pred - y) / y
    return ServiceCurve(base_s=float(coef[0]), per_seq_s=float(coef[1]), per_ctx_token_s=float(coef[2]),
                        prefill_base_s=float(coef[3]), per_prefill_token_s=float(coef[4]), max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, source=source,
                        fit_error={"mean_rel": float(rel.mean()), "max_rel": float(rel.max())})


def with_prefill_table(curve: ServiceCurve, samples: list[StepSample]) -> ServiceCurve:
    """`curve` with its prefill_table from the samples' pure prefill steps (no decoding row), the
    median seconds per number of prompt tokens."""
    by_tokens: dict[int, list[float]] = {}
    for s in samples:
        if s.decode_rows == 0 and s.prefill_tokens > 0:
            by_tokens.setdefault(s.prefill_tokens, []).append(s.seconds)
    table = [[float(n), statistics.median(t)] for n, t in sorted(by_tokens.items())]
    return ServiceCurve.from_dict({**curve.to_dict(), "prefill_table": table})


def with_mixed(curve: ServiceCurve, samples: list[StepSample]) -> ServiceCurve:
    """`curve` with mixed_base_s and mixed_per_seq_s fitted to the samples' mixed steps (decoding rows
    and prompt tokens): least squares, weighted by 1/seconds, of what each step took beyond its
    base_s, its prompt's prefill and its context, over (1, rows); both clipped at zero. Unchanged
    when there are no mixed samples; with one batch size only, the per-row cost stays per_seq_s and
    the rest is the fixed cost."""
    mixed = [s for s in samples if s.decode_rows > 0 and s.prefill_tokens > 0]
    if not mixed:
        return curve
    rest = np.array([s.seconds - curve.base_s - curve.prefill_seconds(s.prefill_tokens)
                     - curve.per_ctx_token_s * s.decode_ctx for s in mixed])
    rows = np.array([float(s.decode_rows) for s in mixed])
    w = 1.0 / np.maximum(np.array([s.seconds for s in mixed]), 1e-6)
    if len(set(rows.tolist())) < 2:
        per_row = curve.per_seq_s
        fixed = float(np.median(rest - per_row * rows))
    else:
        x = np.stack([np.ones_like(rows), rows], axis=1)
        (fixed, per_row), *_ = np.linalg.lstsq(x * w[:, None], rest * w, rcond=None)
        if per_row < 0:                      # noise: the rows cost nothing extra, the rest is fixed
            per_row, fixed = 0.0, float(np.average(rest, weights=w))
    return ServiceCurve.from_dict({**curve.to_dict(), "mixed_base_s": max(0.0, float(fixed)),
                                   "mixed_per_seq_s": max(0.0, float(per_row))})


# --- measuring the real engine --------------------------------------------------------------------

@dataclass(slots=True)
class MeasureConfig:
    engine: str = "smollm2-135m"        # an engine of the packaged deployment (tokenyard/deploy/default.yaml)
    batches: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    contexts: tuple[int, ...] = (32, 128, 320)
    prefills: tuple[int, ...] = (16, 64, 128, 256, 480)
    steps: int = 12                     # decode steps timed per (batch, context)
    repeats: int = 5                    # prefill steps timed per chunk size
    mixed_prefill: int = 128            # prompt tokens of the mixed (decode + prefill) steps timed
    threads: int = 1                    # torch threads (one per replica when replicas share the machine)
    max_num_seqs: int = REPLICA_MAX_NUM_SEQS   # the replica's max_num_seqs (the validation's replicas use it too)


def engine_options(engine: str) -> tuple[Path, dict[str, Any]]:
    """The model and engine options of `engine` in the packaged deployment, as the gateway reads them."""
    from tokenyard.gateway.config.deployment import load_deployment
    dep = load_deployment(ROOT / "tokenyard" / "deploy" / "default.yaml")
    if engine not in dep.engines:
        raise ValueError(f"--engine {engine!r}: not in the packaged deployment ({', '.join(dep.engines)})")
    spec = dep.engines[engine]
    options = dict(spec.options)
    options.pop("speculative_method", None)   # the curve is of plain steps
    assert spec.model is not None
    return spec.model, options


def measure(cfg: MeasureConfig) -> tuple[ServiceCurve, list[StepSample]]:
    import torch

    from tokenyard.engines.core.sampling_params import SamplingParams
    from tokenyard.engines.runtime.engine import Engine
    torch.set_num_threads(cfg.threads)
    model, options = engine_options(cfg.engine)
    options.update(max_num_seqs=cfg.max_num_seqs, progress=False, enable_prefix_caching=False)
    engine = Engine(model, **options)
    budget = engine.config.max_num_batched_tokens
    rng = np.random.default_rng(0)
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(10, 1900, size=n)]

    def drain() -> None:
        while engine.has_unfinished():
            engine.step()

    samples: list[StepSample] = []
    # Prefill: one prompt of n tokens, max_tokens 1 -> the step is the prefill alone (plus sampling).
    for n in cfg.prefills:
        n = min(n, budget)
        times = []
        for _ in range(cfg.repeats + 1):
            engine.add_request(f"p{next(counter)}", prompt(n), SamplingParams(max_tokens=1, temperature=0.0))
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            drain()
        samples.append(StepSample(0, 0, n, statistics.median(times[1:])))     # the first warms up
    # Decode: `b` sequences of context ~c, all prefilled, then `steps` timed decode steps.
    for c in cfg.contexts:
        for b in cfg.batches:
            if b > cfg.max_num_seqs:
                continue
            params = SamplingParams(max_tokens=cfg.steps + 4, temperature=0.0, ignore_eos=True)
            for _ in range(b):
                engine.add_request(f"d{next(counter)}", prompt(c), params)
            # Prefill them all (and take the first decode step or two, which may be mixed).
            while engine.stats().num_waiting or engine.stats().last_step_tokens != b:
                engine.step()
            times = []
            for i in range(cfg.steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            # The context at the middle of the timed steps, summed over the batch.
            samples.append(StepSample(b, b * (c + 2 + cfg.steps // 2), 0, statistics.median(times)))
            if c == cfg.contexts[0] and b < cfg.max_num_seqs:
                # A mixed step: the batch decodes while a new prompt of mixed_prefill tokens is computed.
                n = min(cfg.mixed_prefill, budget - b)
                engine.add_request(f"m{next(counter)}", prompt(n), SamplingParams(max_tokens=1, temperature=0.0))
                t0 = time.perf_counter()
                engine.step()
                samples.append(StepSample(b, b * (c + 3 + cfg.steps), n, time.perf_counter() - t0))
            drain()
    engine.close()
    source = f"{cfg.engine} ({options.get('quantization', 'auto')}), torch CPU, {cfg.threads} thread(s)"
    pure = [s for s in samples if not (s.decode_rows and s.prefill_tokens)]
    return with_mixed(with_prefill_table(fit(pure, cfg.max_num_seqs, budget, source), samples), samples), samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure and fit the fleet simulator's service curve")
    ap.add_argument("--engine", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=REPLICA_MAX_NUM_SEQS)
    ap.add_argument("--quick", action="store_true", help="a smaller grid (seconds), for a look")
    ap.add_argument("--name", default="fleet_service_curve", help="bench/results/<name>.json")
    ap.add_argument("--no-results", action="store_true", help="print only, write nothing")
    args = ap.parse_args(argv)
    from tokenyard.bench.results_io import RunRecorder
    rec = RunRecorder(args.name)
    cfg = MeasureConfig(engine=args.engine, threads=args.threads, max_num_seqs=args.max_num_seqs)
    if args.quick:
        cfg = MeasureConfig(engine=args.engine, threads=args.threads, max_num_seqs=args.max_num_seqs,
                            batches=(1, 4, 16), contexts=(64, 256), prefills=(32, 256), steps=6, repeats=3)
    curve, samples = measure(cfg)
    print(json.dumps(curve.to_dict(), indent=1))
    for s in samples:
        pred = curve.step_s(s.decode_rows, s.decode_ctx, s.prefill_tokens)
        print(f"rows {s.decode_rows:3d} ctx {s.decode_ctx:6d} prefill {s.prefill_tokens:4d}: "
              f"{s.seconds * 1e3:7.2f} ms measured, {pred * 1e3:7.2f} ms by the curve")
    if not args.no_results:
        rec.write({"curve": curve.to_dict(), "measure": asdict(cfg)}, [asdict(s) for s in samples])
    return 0


if __name__ == "__main__":
    sys.exit(main())
