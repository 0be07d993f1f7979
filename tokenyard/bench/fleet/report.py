"""Per-policy figures of a fleet simulation, as a table and a plot.

    goodput      requests per second of the trace that were served within the SLO (TTFT <= slo.ttft_s
                 and mean inter-token gap <= slo.itl_s), and as a share of all requests
    shed         requests refused at once (queue full, predicted wait over the deadline) or dropped
                 from the queue when their deadline passed
    p99 TTFT     over the requests served (a shed request has none)
    replica-h    replica-hours paid over the trace: active (starting, waking, ready, draining) plus
                 sleeping ones at the simulation's sleep_cost_share
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenyard.bench.fleet.simulator import SimConfig, SimResult
from tokenyard.bench.serving_metrics import percentile


@dataclass(slots=True)
class PolicyFigures:
    policy: str
    shedding: bool
    requests: int
    served: int
    goodput_rps: float
    goodput_share: float
    shed: int
    unfinished: int
    p50_ttft_s: float
    p99_ttft_s: float
    p99_itl_s: float
    active_replica_h: float
    asleep_replica_h: float
    cost_replica_h: float
    peak_replicas: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def figures(result: SimResult, cfg: SimConfig, shedding: bool) -> PolicyFigures:
    served = [o for o in result.outcomes if o.status == "served"]
    good = sum(1 for o in served if o.ttft_s is not None and o.ttft_s <= cfg.slo.ttft_s
               and (o.itl_s is None or o.itl_s <= cfg.slo.itl_s))
    shed = sum(1 for o in result.outcomes if o.status.startswith("shed") or o.status == "expired")
    ttfts = [o.ttft_s for o in served if o.ttft_s is not None]
    itls = [o.itl_s for o in served if o.itl_s is not None]
    secs = result.replica_seconds
    active = sum(v for k, v in secs.items() if k not in ("asleep", "gone")) / 3600
    asleep = secs.get("asleep", 0.0) / 3600
    span = max(result.end_s, 1e-9)
    n = len(result.outcomes)
    return PolicyFigures(
        policy=result.policy, shedding=shedding, requests=n, served=len(served), goodput_rps=good / span,
        goodput_share=good / n if n else math.nan, shed=shed,
        unfinished=sum(1 for o in result.outcomes if o.status == "unfinished"),
        p50_ttft_s=percentile(ttfts, 50), p99_ttft_s=percentile(ttfts, 99), p99_itl_s=percentile(itls, 99),
        active_replica_h=active, asleep_replica_h=asleep, cost_replica_h=active + cfg.sleep_cost_share * asleep,
        peak_replicas=max((int(row["ready"]) for row in result.timeline), default=0))


def table(rows: list[PolicyFigures]) -> str:
    """A markdown table, one row per policy run."""
    head = ("| policy | shedding | goodput req/s (share) | shed | p99 TTFT s | p99 ITL ms | replica-h (asleep) "
            "| peak ready |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for f in rows:
        lines.append(f"| {f.policy} | {'on' if f.shedding else 'off'} | {f.goodput_rps:.2f} ({f.goodput_share:.1%}) "
                     f"| {f.shed} | {f.p99_ttft_s:.2f} | {f.p99_itl_s * 1e3:.0f} | {f.cost_replica_h:.1f} "
                     f"({f.asleep_replica_h:.1f}) | {f.peak_replicas} |")
    return "\n".join(lines)


def plot(rows: list[PolicyFigures], results: list[SimResult], rate: list[tuple[float, float]], path: Path) -> Path:
    """Two panels: ready replicas over the trace per policy (shedding on) beside the arrival rate,
    and cost against goodput share per run. A small PNG (committed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=80)
    names = list(dict.fromkeys(f.policy for f in rows))
    color = {n: f"C{i}" for i, n in enumerate(names)}
    hours = [t / 3600 for t, _ in rate]
    ax1r = ax1.twinx()
    ax1r.fill_between(hours, [r for _, r in rate], color="0.85", step="post")
    ax1r.set_ylabel("arrival rate (requests / s, grey)")
    ax1.set_zorder(ax1r.get_zorder() + 1)
    ax1.patch.set_visible(False)
    for f, res in zip(rows, results):
        if f.shedding:
            ax1.step([row["t"] / 3600 for row in res.timeline], [row["ready"] for row in res.timeline], where="post",
                     label=f.policy, lw=1.0, color=color[f.policy])
    ax1.set_xlabel("hour of the trace")
    ax1.set_ylabel("ready replicas")
    ax1.legend(fontsize=7, loc="upper left")
    ax1.set_title("replicas over the trace (shedding on)", fontsize=9)
    floor = 80.0                                  # goodput below this is drawn on the floor, its value written
    for f in rows:
        share = f.goodput_share * 100
        ax2.scatter(f.cost_replica_h, max(share, floor), marker="o" if f.shedding else "x", s=45,
                    color=color[f.policy], label=f"{f.policy}, shedding {'on' if f.shedding else 'off'}")
        if share < floor:
            ax2.annotate(f"{share:.0f}%", (f.cost_replica_h, floor), fontsize=7, xytext=(5, 3), textcoords="offset points")
    ax2.set_ylim(floor - 1, 100.5)
    ax2.set_xlabel("cost (replica-hours)")
    ax2.set_ylabel("goodput (% of requests within the SLO)")
    ax2.set_title("cost against goodput (o: shedding on, x: off)", fontsize=9)
    ax2.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
