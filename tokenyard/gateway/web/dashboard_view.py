"""What the dashboard shows, computed server-side: the page is plain HTML plus SVG, no front-end build.

    spend per model per day   stacked SVG columns + a table (from the hourly rollups)
    tokens per model          prompt / cached / completion, cost per million tokens, savings
    latency percentiles       TTFT and E2E p50/p90/p99 per engine, from the latest records in range
    live engine stats         running, waiting, gateway queue depth, KV usage, busy %, output tok/s,
                              speculation acceptance, SLO attainment (refreshed by dashboard.js)
"""
from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any

from tokenyard.gateway.routes.spend_queries import build_report
from tokenyard.gateway.spend import reports as reports
from tokenyard.gateway.spend import store as store

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f")
LATENCY_SAMPLE = 2000
CHART_W, CHART_H, LEFT, BOTTOM, TOP = 720, 240, 80, 36, 10


def percentile(sorted_values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(p / 100 * len(sorted_values)) - 1))]


def latency_table(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_engine: dict[str, tuple[list[float], list[float]]] = {}
    for r in records:
        ttft, e2e = by_engine.setdefault(r["engine"], ([], []))
        if r.get("ttft_s") is not None:
            ttft.append(r["ttft_s"])
        e2e.append(r["e2e_s"])
    out = []
    for engine in sorted(by_engine):
        ttft, e2e = (sorted(v) for v in by_engine[engine])
        row: dict[str, Any] = {"engine": engine, "n": len(e2e)}
        for name, values in (("ttft", ttft), ("e2e", e2e)):
            for p in (50, 90, 99):
                v = percentile(values, p)
                row[f"{name}_p{p}"] = "" if v is None else f"{v * 1000:.1f}"
        out.append(row)
    return out


_SAMPLES: "weakref.WeakKeyDictionary[Any, dict[str, tuple[float, float, int]]]" = weakref.WeakKeyDictionary()


def live_stats(gw: "Gateway") -> list[dict[str, Any]]:
    """Each engine now: state, queues, KV usage; and since the previous call (the page polls every
    5 s; "-" on the first) its busy share of wall time and output tokens/s;
    speculation acceptance; the share of requests that met the SLO since the gateway started."""
    queued = {name: sum(by_class) for name, (by_class, _) in gw.admission.snapshot().items()}
    samples = _SAMPLES.setdefault(gw, {})
    now = time.monotonic()
    out = []
    for name, h in gw.handles.items():
        s = h.engine.stats()
        then, busy0, tokens0 = samples.get(name, (now, 0.0, 0))
        span = now - then
        samples[name] = (now, s.busy_seconds, s.output_tokens)
        met, total = gw.metrics.slo_counts.get(name, (0, 0))
        out.append({"engine": name, "state": "down" if h.engine.dead else "ok", "running": s.num_running,
                    "waiting": s.num_waiting, "queued": queued.get(name, 0),
                    "kv_usage_pct": f"{s.kv_usage * 100:.1f}",
                    "busy_pct": f"{min(100.0, (s.busy_seconds - busy0) / span * 100):.1f}" if span > 0 else "-",
                    "tokens_per_s": f"{(s.output_tokens - tokens0) / span:.1f}" if span > 0 else "-",
                    "spec_accept_pct": f"{s.spec_acceptance_rate * 100:.1f}" if s.spec_proposer else "-",
                    "slo_met_pct": f"{met / total * 100:.1f}" if total else "-"})
    return out


def spend_chart(by_day_model: list[dict[str, Any]], days: list[str]) -> dict[str, Any]:
    """Geometry of a stacked column chart (cost per day, one colour per model) for the SVG template."""
    models = sorted({r["model"] for r in by_day_model})
    colour = {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(models)}
    per_day: dict[str, list[dict[str, Any]]] = {d: [] for d in days}
    for r in by_day_model:
        per_day.setdefault(r["day"], []).append(r)
    top = max((sum(r["cost_micros"] for r in rows) for rows in per_day.values()), default=0) or 1
    plot_h = CHART_H - BOTTOM - TOP
    slot = (CHART_W - LEFT) / max(1, len(per_day))
    bars, labels = [], []
    for i, (day, rows) in enumerate(sorted(per_day.items())):
        x = LEFT + i * slot + slot * 0.15
        y = CHART_H - BOTTOM
        for r in sorted(rows, key=lambda r: r["model"]):
            h = r["cost_micros"] * plot_h / top
            y -= h
            bars.append({"x": round(x, 1), "y": round(y, 1), "w": round(slot * 0.7, 1), "h": round(h, 1),
                         "fill": colour[r["model"]], "title": f"{day} {r['model']}: {reports.money(r['cost_micros'])}"})
        labels.append({"x": round(x + slot * 0.35, 1), "y": CHART_H - BOTTOM + 16, "text": day[5:]})
    return {"width": CHART_W, "height": CHART_H, "left": LEFT, "base": CHART_H - BOTTOM, "top": TOP,
            "max_label": reports.money(top if top > 1 else 0), "bars": bars, "labels": labels,
            "legend": [{"model": m, "fill": colour[m], "x": LEFT + i * 140} for i, m in enumerate(models)]}


def day_labels(start: float, end: float) -> list[str]:
    first, last = int(start) // 86400, int(end - 1) // 86400
    return [reports.day_label(d * 24) for d in range(first, last + 1)]


BREAKDOWN_ROWS = 20


async def breakdown(gw: "Gateway", tenants: list[str], start: float, end: float, by: str) -> list[dict[str, Any]]:
    """Spend by one dimension (key, user, route or tag:NAME), the costliest BREAKDOWN_ROWS values
    and the rest summed into one row, so the table stays short whatever the cardinality."""
    data = (await build_report(gw, tenants, start, end, [by]))["data"]
    data.sort(key=lambda r: (-r["cost_micros"], r[by]))
    rows, rest = data[:BREAKDOWN_ROWS], data[BREAKDOWN_ROWS:]
    if rest:
        sums = {k: sum(r[k] for r in rest) for k in reports.SUMS}
        rows.append({by: f"{len(rest)} more", **reports.derive(sums)})
    # By key: the key's name (its id when it has none), the id in a second column.
    return [{"label": r.get("key_name") or r[by], "id": r[by] if r.get("key_name") else "",
             "requests": r["requests"], "tokens": r["total_tokens"],
             "cost": reports.money(r["cost_micros"]), "errors": r["errors"]} for r in rows]


async def build(gw: "Gateway", tenants: list[str], days: int, by: str = "key") -> dict[str, Any]:
    end = time.time()
    start = end - days * 86400
    report = await build_report(gw, tenants, start, end, ["day", "model"])
    rows = report["rows"]
    records, _ = await store.records(gw.ledger.redis, gw.deployment.redis_prefix, tenants, limit=LATENCY_SAMPLE,
                                     start=start, end=end, max_scan=LATENCY_SAMPLE * 2)
    total = reports.totals(rows)
    money_total = {k: reports.money(total[k]) for k in ("cost_micros", "baseline_cost_micros", "savings_micros",
                                                       "cost_per_million_tokens_micros")}
    return {"start": reports.iso(start), "end": reports.iso(end), "days": days,
            "baseline_engine": gw.baseline_engine, "total": total, "money_total": money_total,
            "by_day_model": [{**r, "cost": reports.money(r["cost_micros"])} for r in report["data"]],
            "by_model": [{**r, "cost": reports.money(r["cost_micros"]), "savings": reports.money(r["savings_micros"]),
                          "per_million": reports.money(r["cost_per_million_tokens_micros"])}
                         for r in reports.aggregate(rows, ["model"])],
            "chart": spend_chart(report["data"], day_labels(start, end)),
            "latency": latency_table(records), "latency_sample": len(records), "live": live_stats(gw),
            "by": by, "breakdown": await breakdown(gw, tenants, start, end, by)}
