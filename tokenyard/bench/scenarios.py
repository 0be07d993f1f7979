"""The five serving scenarios of issue 14. Each takes launchers (see tokenyard/bench/serve_launch.py),
runs its load, writes `<out>/serve_<name>.json` and `.png`, and returns a markdown table.

1. rate_sweep     the highest request rate each server sustains with p99 TTFT under an SLO (and
                  no failures), and the output-throughput ratio between them there.
2. priorities     interactive requests (the dev key) arriving at a steady rate while batch requests
                  (a key of admission class "batch") flood the same engine; against a control run
                  where both classes use the interactive key.
3. router         the task suite through model "auto" against the large engine pinned: accuracy by
                  the suite's checkers on the returned text, cost = usage x the deployment's prices.
4. prefix         shared-prefix chat with prefix caching on vs off: cached prompt tokens and TTFT.
5. speculation    the same requests with speculative_method ngram vs none: TPOT, ITL, throughput.

Servers run one at a time (two servers on two cores would measure each other).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from tokenyard.bench.load_generator import UNFINISHED, ChatRequest, LoadConfig, LoadResult, run_load, run_load_async
from tokenyard.bench.serve_launch import Endpoint, Launcher
from tokenyard.bench.serving_metrics import SLO, RequestRecord, Summary, format_summary, summarize


@dataclass(slots=True)
class RunOptions:
    """What every scenario shares."""

    out_dir: Path = Path("bench/out")
    seed: int = 0
    burstiness: float = 1.0
    timeout_s: float = 600.0
    progress: bool = True
    warmup: int = 2                          # requests sent (and dropped) before measuring each server
    quiet: bool = False                      # no per-run summaries printed


def _load_cfg(ep: Endpoint, opts: RunOptions, rate: float = math.inf, concurrency: int | None = None,
              api_key: str | None = None, model: str | None = None) -> LoadConfig:
    return LoadConfig(ep.base_url, api_key or ep.api_key, model or ep.model, rate, opts.burstiness, concurrency,
                      seed=opts.seed, timeout_s=opts.timeout_s, progress=opts.progress)


def _warm(ep: Endpoint, requests: Sequence[ChatRequest], opts: RunOptions, model: str | None = None) -> None:
    if opts.warmup and requests:
        cfg = _load_cfg(ep, opts, concurrency=1, model=model)
        cfg.progress = False
        run_load(list(requests[:opts.warmup]), cfg)


def _measure(ep: Endpoint, requests: Sequence[ChatRequest], cfg: LoadConfig, slo: SLO | None,
             opts: RunOptions, label: str) -> tuple[Summary, LoadResult]:
    res = run_load(list(requests), cfg)
    s = summarize(res.records, res.duration_s, slo)
    if not opts.quiet:
        print(format_summary(f"{ep.name} {label}", s), flush=True)
    return s, res


def _write(opts: RunOptions, name: str, result: dict[str, Any], table: str) -> dict[str, Any]:
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    result["table"] = table
    (opts.out_dir / f"serve_{name}.json").write_text(json.dumps(result, indent=2, default=_json_default))
    return result


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and math.isnan(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bar_plot(path: Path, title: str, panels: dict[str, dict[str, float]]) -> None:
    """One bar panel per metric: {metric label: {series: value}}."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (label, values) in zip(axes[0], panels.items()):
        names = list(values)
        ax.bar(names, [0 if v is None or math.isnan(v) else v for v in values.values()],
               color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(names)])
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- 1. rate sweep --------------------------------------------------------------------------------

@dataclass(slots=True)
class SweepConfig:
    rates: list[float]                       # requests/s; math.inf = all at once
    ttft_slo_ms: float = 2000.0              # p99 TTFT must stay under this for a rate to count
    tpot_slo_ms: float | None = None         # for goodput only
    stop_after_miss: bool = True             # skip higher rates once p99 TTFT > 4x the SLO (saves hours)
    duration_s: float | None = None          # hold each rate this long (Poisson arrivals); None: one burst
    drain_s: float = 30.0                    # held: cancel what still runs this long after the last arrival
    dataset_size: int = 96                   # burst: the requests; held: distinct prompts at least
    rates_by_server: dict[str, list[float]] = field(default_factory=dict)   # a server's own ladder

    @property
    def held(self) -> bool:
        return self.duration_s is not None

    def rates_for(self, server: str) -> list[float]:
        rates = self.rates_by_server.get(server) or self.rates
        return sorted(rates) if self.held else list(rates)


def _sustains(s: Summary, cfg: SweepConfig) -> bool:
    return s.failed == 0 and s.completed > 0 and s.ttft.percentiles["p99"] <= cfg.ttft_slo_ms


def _dataset_size(cfg: SweepConfig, opts: RunOptions) -> int:
    """Held loads send a fresh prompt per arrival (a repeated prompt would hit the prefix cache)."""
    if not cfg.held:
        return cfg.dataset_size
    from tokenyard.bench.load_generator import held_offsets
    every = cfg.rates + [r for rs in cfg.rates_by_server.values() for r in rs]
    most = max(len(held_offsets(r, cfg.duration_s, opts.burstiness, opts.seed)) for r in every)
    return max(cfg.dataset_size, most)


def rate_sweep(servers: dict[str, Launcher], make_requests: Callable[[int], list[ChatRequest]], cfg: SweepConfig,
               opts: RunOptions) -> dict[str, Any]:
    """servers: name -> launcher, the first being ours (the ratio is first / last).

    Held (cfg.duration_s): each rate is a Poisson load held for duration_s, rates in increasing
    order, and a server stops at its first rate that misses the SLO: a held overload only
    grows its queue, so higher rates cannot meet it either, and each costs a full duration."""
    requests = make_requests(_dataset_size(cfg, opts))
    slo = SLO(ttft_ms=cfg.ttft_slo_ms, tpot_ms=cfg.tpot_slo_ms)
    points: dict[str, list[dict[str, Any]]] = {}
    for name, launch in servers.items():
        points[name] = []
        with launch() as ep:
            _warm(ep, requests, opts)
            for rate in cfg.rates_for(name):
                load = _load_cfg(ep, opts, rate)
                load.duration_s, load.drain_s = cfg.duration_s, cfg.drain_s if cfg.held else None
                s, res = _measure(ep, requests, load, slo, opts, f"rate {rate:g}/s")
                point = {"rate": rate, "sustained": _sustains(s, cfg), "summary": s.to_dict()}
                if cfg.held:
                    point["held_s"] = cfg.duration_s
                    point["arrivals"] = len(res.records)
                    point["unfinished"] = sum(r.error == UNFINISHED for r in res.records)
                    point["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]   # a shared machine
                points[name].append(point)
                if cfg.held and not point["sustained"]:
                    break
                if cfg.stop_after_miss and s.ttft.percentiles["p99"] > 4 * cfg.ttft_slo_ms:
                    break
    best: dict[str, dict[str, Any] | None] = {}
    for name, pts in points.items():
        ok = [p for p in pts if p["sustained"]]
        best[name] = max(ok, key=lambda p: p["rate"]) if ok else None
    names = list(points)
    ratio = None
    if len(names) >= 2 and best[names[0]] and best[names[-1]]:
        theirs = best[names[-1]]["summary"]["output_throughput"]
        ratio = best[names[0]]["summary"]["output_throughput"] / theirs if theirs else None
    # Also at each rate both servers ran: the offered load is equal there, so this ratio is
    # meaningful even when the baseline sustains no rate under the SLO.
    ratio_by_rate: dict[str, float] = {}
    if len(names) >= 2:
        theirs_at = {p["rate"]: p["summary"]["output_throughput"] for p in points[names[-1]]}
        for p in points[names[0]]:
            if theirs_at.get(p["rate"]):
                ratio_by_rate[f"{p['rate']:g}"] = p["summary"]["output_throughput"] / theirs_at[p["rate"]]
    rows = []
    for name, pts in points.items():
        for p in pts:
            s = p["summary"]
            rows.append([name, f"{p['rate']:g}", f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                         _fmt(s["ttft"]["median"]), _fmt(s["ttft"]["percentiles"]["p99"]),
                         _fmt(s["tpot"]["median"]), _fmt(s["itl"]["percentiles"]["p99"]),
                         _fmt(s["e2e"]["median"]), _fmt(s["goodput"], 2), s["failed"],
                         "yes" if p["sustained"] else "no"])
    table = _table(["server", "rate (req/s)", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                    "ITL p99 ms", "E2E p50 ms", "goodput req/s", "failed", f"p99 TTFT <= {cfg.ttft_slo_ms:g} ms"],
                   rows)
    summary_lines = [f"{n}: highest sustained rate {b['rate']:g} req/s, {b['summary']['output_throughput']:.1f} "
                     f"output tok/s" if b else f"{n}: no rate met p99 TTFT <= {cfg.ttft_slo_ms:g} ms"
                     for n, b in best.items()]
    if ratio is not None:
        summary_lines.append(f"throughput ratio {names[0]} / {names[-1]} at those rates: {ratio:.2f}x")
    summary_lines += [f"output throughput ratio at {r} req/s offered: {v:.2f}x" for r, v in ratio_by_rate.items()]
    table += "\n\n" + "\n".join(summary_lines)
    _plot_sweep(opts.out_dir / "serve_rate_sweep.png", points, cfg)
    result = {"scenario": "rate_sweep", "slo": asdict(slo), "rates": {n: cfg.rates_for(n) for n in servers},
              "num_requests": len(requests),
              "held_s": cfg.duration_s, "drain_s": cfg.drain_s if cfg.held else None,
              "points": points, "highest_sustained_rate": {n: (b["rate"] if b else None) for n, b in best.items()},
              "throughput_ratio": ratio, "throughput_ratio_by_rate": ratio_by_rate}
    return _write(opts, "rate_sweep", result, table)


def _plot_sweep(path: Path, points: dict[str, list[dict[str, Any]]], cfg: SweepConfig) -> None:
    plt = _plt()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, pts in points.items():
        x = [p["summary"]["output_throughput"] for p in pts]
        axes[0].plot(x, [p["summary"]["ttft"]["percentiles"]["p99"] for p in pts], "o-", label=name)
        axes[1].plot(x, [p["summary"]["tpot"]["median"] for p in pts], "o-", label=name)
        axes[2].plot([p["summary"]["request_throughput"] for p in pts],
                     [p["summary"]["e2e"]["median"] for p in pts], "o-", label=name)
    axes[0].axhline(cfg.ttft_slo_ms, color="grey", ls="--", lw=1, label="SLO")
    for ax, (xl, yl) in zip(axes, (("output tok/s", "p99 TTFT (ms)"), ("output tok/s", "median TPOT (ms)"),
                                   ("requests/s", "median E2E (ms)"))):
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("latency vs throughput across request rates", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- 2. priorities --------------------------------------------------------------------------------

@dataclass(slots=True)
class PriorityConfig:
    interactive_rate: float = 2.0            # interactive requests per second (Poisson)
    batch_concurrency: int | None = None     # batch requests in flight (None: all at once)


def priorities(gateway: Launcher, interactive: list[ChatRequest], batch: list[ChatRequest], cfg: PriorityConfig,
               opts: RunOptions) -> dict[str, Any]:
    """The same mixed load twice: batch requests on a "batch"-class key (priorities on), then on
    the interactive key (control). Pending, with a message, when the gateway has no batch key."""
    runs: dict[str, dict[str, Any]] = {}
    with gateway() as ep:
        if not ep.batch_api_key:
            msg = ("pending: this gateway has no admission class for batch keys (needs `tokenyard keys create "
                   "--priority batch`, issue 10); scenario not run")
            return _write(opts, "priorities", {"scenario": "priorities", "status": "pending", "message": msg}, msg)
        _warm(ep, interactive, opts)
        for label, batch_key in (("priorities on", ep.batch_api_key), ("control (one class)", ep.api_key)):
            i_cfg = _load_cfg(ep, opts, cfg.interactive_rate)
            b_cfg = _load_cfg(ep, opts, math.inf, cfg.batch_concurrency, api_key=batch_key)
            b_cfg.progress = False

            async def both() -> tuple[LoadResult, LoadResult]:
                # The batch flood starts first; interactive arrivals then meet a busy engine.
                b_task = asyncio.ensure_future(run_load_async(batch, b_cfg))
                await asyncio.sleep(0.05)
                return await run_load_async(interactive, i_cfg), await b_task

            i_res, b_res = asyncio.run(both())
            runs[label] = {"interactive": summarize(i_res.records, i_res.duration_s).to_dict(),
                           "batch": summarize(b_res.records, b_res.duration_s).to_dict()}
    rows = [[label, cls, r[cls]["completed"], r[cls]["failed"], _fmt(r[cls]["ttft"]["median"]),
             _fmt(r[cls]["ttft"]["percentiles"]["p99"]), _fmt(r[cls]["tpot"]["median"]), _fmt(r[cls]["e2e"]["median"]),
             _fmt(r[cls]["output_throughput"])]
            for label, r in runs.items() for cls in ("interactive", "batch")]
    table = _table(["run", "class", "done", "failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "E2E p50 ms",
                    "out tok/s"], rows)
    _bar_plot(opts.out_dir / "serve_priorities.png", "interactive under a batch flood",
              {"interactive TTFT p99 (ms)": {k: v["interactive"]["ttft"]["percentiles"]["p99"] for k, v in runs.items()},
               "batch E2E p50 (ms)": {k: v["batch"]["e2e"]["median"] for k, v in runs.items()}})
    result = {"scenario": "priorities", "status": "done", "config": asdict(cfg), "runs": runs}
    return _write(opts, "priorities", result, table)


# --- 3. router on vs all-large --------------------------------------------------------------------

def _prices(deployment: Path | None) -> dict[str, Any]:
    if deployment is None:
        return {}
    from tokenyard.gateway.config.deployment import load_deployment
    return {name: spec.prices for name, spec in load_deployment(deployment).engines.items()}


def _cost(records: Sequence[RequestRecord], prices: dict[str, Any]) -> int:
    """Micro-units, the gateway's own rounding per request (tokenyard.policies.schema.Prices.cost)."""
    total = 0
    for r in records:
        if r.ok and r.model in prices:
            total += prices[r.model].cost(r.prompt_tokens, r.cached_tokens, r.output_tokens)
    return total


def router(gateway: Launcher, requests: list[ChatRequest], large: str, opts: RunOptions,
           concurrency: int = 8) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    with gateway() as ep:
        prices = _prices(ep.deployment)
        _warm(ep, requests, opts)
        for label, model in (("router (auto)", "auto"), (f"all-large ({large})", large)):
            res = run_load(requests, _load_cfg(ep, opts, math.inf, concurrency, model=model))
            s = summarize(res.records, res.duration_s)
            ok = [(req, rec) for req, rec in zip(requests, res.records) if rec.ok]
            correct = sum(1 for req, rec in ok if req.check is not None and req.check.check(rec.text))
            served: dict[str, int] = {}
            for _, rec in ok:
                served[rec.model] = served.get(rec.model, 0) + 1
            cost = _cost(res.records, prices)
            runs[label] = {"model": model, "accuracy": correct / len(requests) if requests else math.nan,
                           "cost_micro": cost, "cost_per_1k_requests": 1000 * cost / max(1, len(ok)) / 1e6,
                           "served_by": served, "summary": s.to_dict()}
    rows = [[label, f"{r['accuracy']:.3f}", r["cost_micro"], f"{r['cost_per_1k_requests']:.4f}",
             ", ".join(f"{k} {v}" for k, v in sorted(r["served_by"].items())),
             _fmt(r["summary"]["e2e"]["median"]), r["summary"]["failed"]] for label, r in runs.items()]
    table = _table(["run", "accuracy", "cost (micro-units)", "cost / 1k requests", "served by", "E2E p50 ms",
                    "failed"], rows)
    labels = list(runs)
    if len(labels) == 2 and runs[labels[1]]["cost_micro"]:
        saving = 1 - runs[labels[0]]["cost_micro"] / runs[labels[1]]["cost_micro"]
        table += (f"\n\nrouter saves {100 * saving:.1f}% of the cost; accuracy "
                  f"{runs[labels[0]]['accuracy']:.3f} vs {runs[labels[1]]['accuracy']:.3f}")
    _bar_plot(opts.out_dir / "serve_router.png", "router on vs all-large",
              {"accuracy": {k: v["accuracy"] for k, v in runs.items()},
               "cost (micro-units)": {k: float(v["cost_micro"]) for k, v in runs.items()}})
    return _write(opts, "router", {"scenario": "router", "num_requests": len(requests), "runs": runs}, table)


# --- 4. prefix-heavy chat -------------------------------------------------------------------------

def prefix_chat(servers: dict[str, Launcher], requests: list[ChatRequest], opts: RunOptions,
                rate: float = math.inf, concurrency: int | None = 8) -> dict[str, Any]:
    """servers: e.g. {"prefix cache on": ..., "prefix cache off": ...}."""
    runs: dict[str, dict[str, Any]] = {}
    for label, launch in servers.items():
        with launch() as ep:
            s, _ = _measure(ep, requests, _load_cfg(ep, opts, rate, concurrency), None, opts, label)
            d = s.to_dict()
            d["cached_fraction"] = s.total_cached_tokens / s.total_prompt_tokens if s.total_prompt_tokens else 0.0
            runs[label] = d
    rows = [[label, r["completed"], r["total_prompt_tokens"], r["total_cached_tokens"], f"{r['cached_fraction']:.3f}",
             _fmt(r["ttft"]["median"]), _fmt(r["ttft"]["percentiles"]["p99"]), _fmt(r["request_throughput"], 2),
             r["failed"]] for label, r in runs.items()]
    table = _table(["run", "done", "prompt tokens", "cached tokens", "cached share", "TTFT p50 ms", "TTFT p99 ms",
                    "req/s", "failed"], rows)
    _bar_plot(opts.out_dir / "serve_prefix.png", "shared-prefix chat",
              {"cached share of prompt tokens": {k: v["cached_fraction"] for k, v in runs.items()},
               "TTFT p50 (ms)": {k: v["ttft"]["median"] for k, v in runs.items()}})
    return _write(opts, "prefix", {"scenario": "prefix", "num_requests": len(requests), "runs": runs}, table)


# --- 5. speculation on vs off ---------------------------------------------------------------------

def speculation(servers: dict[str, Launcher], requests: list[ChatRequest], opts: RunOptions,
                concurrency: int = 1) -> dict[str, Any]:
    """servers: e.g. {"ngram": ..., "none": ...}. Low concurrency: speculation pays where a step
    is bound by reading weights (engine option spec_max_batch turns it off above 8)."""
    runs: dict[str, dict[str, Any]] = {}
    texts: dict[str, list[str]] = {}
    for label, launch in servers.items():
        with launch() as ep:
            _warm(ep, requests, opts)
            s, res = _measure(ep, requests, _load_cfg(ep, opts, math.inf, concurrency), None, opts, label)
            runs[label] = s.to_dict()
            texts[label] = [r.text for r in res.records]
            checked = [(q, r) for q, r in zip(requests, res.records) if q.check is not None]
            if checked:
                runs[label]["accuracy"] = sum(q.check.check(r.text) for q, r in checked if r.ok) / len(checked)
    labels = list(runs)
    same = None
    if len(labels) == 2:
        a, b = texts[labels[0]], texts[labels[1]]
        same = sum(x == y for x, y in zip(a, b)) / max(1, len(a))
    rows = [[label, r["completed"], _fmt(r["tpot"]["median"]), _fmt(r["tpot"]["percentiles"]["p99"]),
             _fmt(r["itl"]["median"]), _fmt(r["ttft"]["median"]), _fmt(r["output_throughput"]),
             _fmt(r.get("accuracy"), 3), r["failed"]] for label, r in runs.items()]
    table = _table(["speculation", "done", "TPOT p50 ms", "TPOT p99 ms", "ITL p50 ms", "TTFT p50 ms", "out tok/s",
                    "accuracy", "failed"], rows)
    if same is not None:
        table += f"\n\nidentical replies (greedy): {100 * same:.1f}%"
    _bar_plot(opts.out_dir / "serve_speculation.png", f"speculation on vs off (concurrency {concurrency})",
              {"TPOT p50 (ms)": {k: v["tpot"]["median"] for k, v in runs.items()},
               "output tok/s": {k: v["output_throughput"] for k, v in runs.items()}})
    result = {"scenario": "speculation", "concurrency": concurrency, "num_requests": len(requests), "runs": runs,
              "identical_replies": same}
    return _write(opts, "speculation", result, table)
