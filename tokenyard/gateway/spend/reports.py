"""Spend reports: rollup rows grouped by model, tenant, day, hour and at most one more dimension
(key, user, route, adapter, tag:NAME); JSON rows, CSV and text tables. `model,adapter` is the spend of
each engine's LoRA adapters (model ENGINE:ADAPTER), the base in the adapter's "(none)" group.

Grouping by a dimension reads that dimension's rollups. Its "(none)" group holds every record without a
value for it (and records from before dimension rollups existed): the ungrouped total less the
dimension's rows, so the groups always add up to the total, to the micro-unit. Per tenant and
hour a dimension keeps spend.max_values_per_dimension distinct values; later values are counted
under "(other)". Two or more dimensions at once are answered from the request stream (exact, for
the stream's retention window; `source: "stream"` in the report).

Pure functions (no Redis, no HTTP), shared by GET /v1/spend/report, the dashboard and
`tokenyard spend report`. All money is integer micro-units; nothing here uses a float for it.

Grouping by key adds a key_name column (the key's name from the key store, "" when it has none or
is gone) beside the key id: tables and CSV show the name first, the id second.

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

from tokenyard.gateway.edge.edge_params import read_time
from tokenyard.gateway.spend.store import RollupRow

GROUPS = ("model", "tenant", "day", "hour")
DIMENSIONS = ("key", "user", "route", "adapter")     # and tag:NAME, NAME a metadata key; adapter: the LoRA one
NONE = "(none)"      # a dimension's group of the records without a value for it (CLI, CSV, JSON, dashboard)
SUMS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros", "baseline_cost_micros",
        "errors")
COLUMNS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "cost_micros",
           "baseline_cost_micros", "savings_micros", "cost_per_million_tokens_micros", "errors")


def is_dimension(group: str) -> bool:
    return group in DIMENSIONS or (group.startswith("tag:") and 0 < len(group) - 4 <= 64)


def parse_group_by(value: str | None) -> list[str]:
    """"model", or several joined by commas ("day,model", "model,tag:team"). ValueError names what is wrong."""
    parts = [p.strip() for p in (value or "model").split(",") if p.strip()]
    bad = [p for p in parts if p not in GROUPS and not is_dimension(p)]
    if bad or not parts or len(set(parts)) != len(parts):
        raise ValueError(f"group_by must be one or more of {', '.join(GROUPS + DIMENSIONS)}, tag:NAME "
                         "(comma-separated, no repeats)")
    return parts


def dimensions(group_by: list[str]) -> list[str]:
    return [g for g in group_by if is_dimension(g)]


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
    return tuple(label[g] if g in label else row.value for g in group_by)


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


def aggregate_with_dimension(rows: list[RollupRow], dim_rows: list[RollupRow], group_by: list[str]
                             ) -> list[dict[str, Any]]:
    """Groups by the base labels and one dimension; the dimension's "(none)" group is what its rows do
    not cover (records without a value), so every base group still adds up exactly."""
    base_by = [g for g in group_by if not is_dimension(g)]
    remainder: dict[tuple[str, ...], dict[str, int]] = {}
    for row in rows:
        acc = remainder.setdefault(_key(row, base_by), dict.fromkeys(SUMS, 0))
        for k in SUMS:
            acc[k] += getattr(row, k)
    groups: dict[tuple[str, ...], dict[str, int]] = {}
    for row in dim_rows:
        acc = groups.setdefault(_key(row, group_by), dict.fromkeys(SUMS, 0))
        rest = remainder.setdefault(_key(row, base_by), dict.fromkeys(SUMS, 0))
        for k in SUMS:
            acc[k] += getattr(row, k)
            rest[k] -= getattr(row, k)
    at = group_by.index(dimensions(group_by)[0])
    for base, acc in remainder.items():
        if any(acc.values()):
            groups[base[:at] + (NONE,) + base[at:]] = acc
    return [{**dict(zip(group_by, key)), **derive(groups[key])} for key in sorted(groups)]


class RecordGroups:
    """Groups straight from usage records (the stream), any combination of groups and dimensions,
    added a page at a time: a report over 200,000 records holds the groups' sums, never the records
    (which would also make every full garbage collection walk them, a pause of the whole process)."""

    __slots__ = ("group_by", "groups", "total", "count")

    def __init__(self, group_by: list[str]) -> None:
        self.group_by = group_by
        self.groups: dict[tuple[str, ...], dict[str, int]] = {}
        self.total = dict.fromkeys(SUMS, 0)
        self.count = 0

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        for rec in records:
            acc = self.groups.setdefault(record_labels(rec, self.group_by), dict.fromkeys(SUMS, 0))
            for k, v in record_sums(rec).items():
                acc[k] += v
                self.total[k] += v
            self.count += 1

    def rows(self) -> list[dict[str, Any]]:
        return [{**dict(zip(self.group_by, key)), **derive(self.groups[key])} for key in sorted(self.groups)]


def aggregate_records(records: Iterable[dict[str, Any]], group_by: list[str]) -> list[dict[str, Any]]:
    """Groups straight from usage records (the stream): any combination of groups and dimensions."""
    acc = RecordGroups(group_by)
    acc.add(records)
    return acc.rows()


def record_sums(rec: dict[str, Any]) -> dict[str, int]:
    return {"requests": 1, "prompt_tokens": int(rec["prompt_tokens"]), "cached_tokens": int(rec["cached_tokens"]),
            "completion_tokens": int(rec["completion_tokens"]), "cost_micros": int(rec["cost_micros"]),
            "baseline_cost_micros": int(rec.get("baseline_cost_micros", 0)),
            "errors": 0 if rec.get("status") == "ok" else 1}


def record_labels(rec: dict[str, Any], group_by: list[str]) -> tuple[str, ...]:
    hour = int(rec["time"]) // 3600
    out = []
    for g in group_by:
        if g == "model":
            out.append(rec["engine"])
        elif g == "tenant":
            out.append(rec.get("tenant") or "-")
        elif g == "day":
            out.append(day_label(hour))
        elif g == "hour":
            out.append(hour_label(hour))
        elif g == "key":
            out.append(rec.get("key_id") or NONE)
        elif g == "user":
            out.append(rec.get("user") or NONE)
        elif g == "route":
            out.append(rec.get("route_reason") or NONE)
        elif g == "adapter":
            out.append(rec.get("lora") or NONE)
        else:
            out.append(str((rec.get("tags") or {}).get(g[4:], "")) or NONE)
    return tuple(out)


def label_columns(group_by: list[str]) -> list[str]:
    """The label columns of a table or CSV: the groups, with key_name before key (the id)."""
    return [c for g in group_by for c in (("key_name", "key") if g == "key" else (g,))]


def with_key_names(data: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    """Each row of a report grouped by key gets key_name (from `names`, key id -> name), placed
    before its key id; "(none)", "(other)" and keys without a name get ""."""
    out = []
    for row in data:
        new: dict[str, Any] = {}
        for k, v in row.items():
            if k == "key":
                new["key_name"] = names.get(v, "")
            new[k] = v
        out.append(new)
    return out


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
    labels = label_columns(group_by)
    w.writerow([*labels, *COLUMNS])
    for row in data:
        w.writerow([_csv_safe(str(row.get(g, ""))) for g in labels] + ["" if row[c] is None else row[c] for c in COLUMNS])
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
    labels = label_columns(group_by)
    cols = [*labels, "requests", "prompt", "cached", "completion", "cost", "cost/1M tok", "baseline", "savings"]
    lines = []
    for row in [*data, *([{**dict.fromkeys(labels, ""), labels[0]: "TOTAL", **total}] if total else [])]:
        lines.append([*(str(row.get(g, "")) for g in labels), str(row["requests"]), str(row["prompt_tokens"]),
                      str(row["cached_tokens"]), str(row["completion_tokens"]), money(row["cost_micros"]),
                      money(row["cost_per_million_tokens_micros"]), money(row["baseline_cost_micros"]),
                      money(row["savings_micros"])])
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    numeric = set(range(len(labels), len(cols)))
    out = []
    for line in [cols, *lines]:
        out.append("  ".join(v.rjust(w) if i in numeric else v.ljust(w)
                             for i, (v, w) in enumerate(zip(line, widths))).rstrip())
    return "\n".join(out) + "\n"
