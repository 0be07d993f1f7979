"""Spend reports: rollup rows grouped by model, tenant, day or hour; JSON rows, CSV and text tables.

Pure functions (no Redis, no HTTP), shared by GET /v1/spend/report, the dashboard and
`tokenyard spend report`. All money is integer micro-units; nothing here uses a float for it.

Derived columns:
  total_tokens                    prompt + completion
  savings_micros                  baseline_cost_micros - cost_micros: what the same tokens would have
                                  cost on the baseline ("large") engine, less what they cost
  cost_per_million_tokens_micros  cost_micros x 1e6 / total_tokens, rounded half up (null: no tokens)
"""
from __future__ import annotations

import csv
import io
from datetime import datetime, timezone
from typing import Any, Iterable

from gateway.http.edge_params import read_time
from gateway.spend.store import RollupRow

GROUPS = ("model", "tenant", "day", "hour")
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros", "baseline_cost_micros",
        "errors")
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "cost_micros",
           "baseline_cost_micros", "savings_micros", "cost_per_million_tokens_micros", "errors")


def parse_group_by(value: str | None) -> list[str]:
    """"model", or several joined by commas ("day,model"). ValueError names what is wrong."""
    parts = [p.strip() for p in (value or "model").split(",") if p.strip()]
    bad = [p for p in parts if p not in GROUPS]
    if bad or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"group_by must be one or more of {', '.join(GROUPS)} (comma-separated, no repeats)")
    return parts


def parse_time(value: str) -> float:
    """Unix seconds, or ISO 8601 (a date, or a date and time; UTC unless an offset is given)."""
    return read_time(value)


def parse_since(value: str, now: float | None = None) -> float:
    """"7d", "12h", "30m", "2w" before now, or an absolute time (parse_time)."""
    return read_time(value, now, relative=True)


def hour_range(start: float, end: float) -> tuple[int, int]:
    """Rollup hours covered by [start, end): every hour whose start lies in it (start rounds up to the hour,
    so a report never includes traffic from before `start`)."""
    return -(-int(start) // 3600), -(-int(end) // 3600)


def day_label(hour: int) -> str:
    return datetime.fromtimestamp(hour * 3600, timezone.utc).strftime("%Y-%m-%d")


def hour_label(hour: int) -> str:
    return datetime.fromtimestamp(hour * 3600, timezone.utc).strftime("%Y-%m-%dT%H:00Z")


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _key(row: RollupRow, group_by: list[str]) -> tuple[str, ...]:
    label = {"model": row.engine, "tenant": row.tenant, "day": day_label(row.hour), "hour": hour_label(row.hour)}
    return tuple(label[g] for g in group_by)


def derive(sums: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {k: sums.get(k, 0) for k in SUMS}
    total = out["prompt_tokens"] + out["completion_tokens"]
    out["total_tokens"] = total
    out["savings_micros"] = out["baseline_cost_micros"] - out["cost_micros"]
    out["cost_per_million_tokens_micros"] = (out["cost_micros"] * 1_000_000 + total // 2) // total if total else None
    return {k: out[k] for k in COLUMNS}


def aggregate(rows: Iterable[RollupRow], group_by: list[str]) -> list[dict[str, Any]]:
    """One dict per group (the group's labels first, then COLUMNS), sorted by the labels."""
    groups: dict[tuple[str, ...], dict[str, int]] = {}
    for row in rows:
        acc = groups.setdefault(_key(row, group_by), dict.fromkeys(SUMS, 0))
        for k in SUMS:
            acc[k] += getattr(row, k)
    return [{**dict(zip(group_by, key)), **derive(groups[key])} for key in sorted(groups)]


def totals(rows: Iterable[RollupRow]) -> dict[str, Any]:
    acc = dict.fromkeys(SUMS, 0)
    for row in rows:
        for k in SUMS:
            acc[k] += getattr(row, k)
    return derive(acc)


def to_csv(data: list[dict[str, Any]], group_by: list[str]) -> str:
    """Header: the group columns, then COLUMNS; one line per group; integers only (empty: no value)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow([*group_by, *COLUMNS])
    for row in data:
        w.writerow([_csv_safe(row[g]) for g in group_by] + ["" if row[c] is None else row[c] for c in COLUMNS])
    return buf.getvalue()


def _csv_safe(label: str) -> str:
    """Labels are tenant/engine names (A-Z a-z 0-9 . _ -) or dates; still, never let a cell start a formula."""
    return "'" + label if label[:1] in ("=", "+", "-", "@") else label


def money(micros: int | None) -> str:
    """Micro-units as a decimal string of currency units, by integer arithmetic: 1234567 -> "1.234567"."""
    if micros is None:
        return ""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), 1_000_000)
    return f"{sign}{whole}.{frac:06d}"


def table(data: list[dict[str, Any]], group_by: list[str], total: dict[str, Any] | None = None) -> str:
    """A plain-text table for terminals: money in currency units, tokens as integers."""
    cols = [*group_by, "requests", "prompt", "cached", "completion", "cost", "cost/1M tok", "baseline", "savings"]
    lines = []
    for row in [*data, *([{**dict.fromkeys(group_by, ""), group_by[0]: "TOTAL", **total}] if total else [])]:
        lines.append([*(str(row[g]) for g in group_by), str(row["requests"]), str(row["prompt_tokens"]),
                      str(row["cached_tokens"]), str(row["completion_tokens"]), money(row["cost_micros"]),
                      money(row["cost_per_million_tokens_micros"]), money(row["baseline_cost_micros"]),
                      money(row["savings_micros"])])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    numeric = set(range(len(group_by), len(cols)))
    out = []
    for line in [cols, *lines]:
        out.append("  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                             for i, (v, w) in enumerate(zip(line, widths))).rstrip())
    return "\n".join(out) + "\n"
