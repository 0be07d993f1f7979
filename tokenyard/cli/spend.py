"""`tokenyard spend report`: the spend ledger's rollups as a table (or CSV / JSON) in the terminal;
`tokenyard spend alerts`: the budget alerts fired (the alerts stream) and the webhook outbox.

    tokenyard spend report --by model --since 7d
    tokenyard spend report --by day,model --since 2026-11-01 --until 2026-12-01 --tenant acme --format csv
    tokenyard spend alerts --since 7d [--tenant acme] [--format table|json]

Reads the deployment's Redis directly (like `tokenyard keys`: --redis-url, else REDIS_URL, else the
deployment's redis_url, else the embedded redis-server under redis_dir) with every tenant visible:
whoever can run it can read that Redis anyway. Money is printed in currency units from integer
micro-units (integer arithmetic; "1.234567" is 1234567 micro-units).

The gateway's modules (and with them redis, starlette and the policies) are imported inside the functions
that run a command, so `tokenyard spend --help` stays as quick as `tokenyard --help`
(tests/packaging/test_cli_startup.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    ap.add_argument("--redis-url", help="Redis to use (default: REDIS_URL, then the deployment's)")
    sub = ap.add_subparsers(dest="spend_command", required=True)
    rep = sub.add_parser("report", help="spend, tokens, cost per 1M tokens and savings, grouped")
    rep.add_argument("--by", default="model", help=("model, tenant, day, hour, key, user, route, adapter or tag:NAME; several "
                                                    "comma-separated (two or more of key/user/route/tag: from the "
                                                    "request stream)"))
    rep.add_argument("--since", default="7d", help="7d, 12h, 30m, 2w before now, or unix seconds / ISO 8601")
    rep.add_argument("--until", help="end (unix seconds / ISO 8601; default: now)")
    rep.add_argument("--tenant", help="only this tenant")
    rep.add_argument("--format", choices=("table", "csv", "json"), default="table")
    # Also accepted after `report` (SUPPRESS: not given there keeps the value given before it).
    rep.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    rep.add_argument("--redis-url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    al = sub.add_parser("alerts", help="budget alerts fired (50/80/100 %% of a limit), oldest first")
    al.add_argument("--since", default="7d", help="7d, 12h, 30m, 2w before now, or unix seconds / ISO 8601")
    al.add_argument("--until", help="end (unix seconds / ISO 8601; default: now)")
    al.add_argument("--tenant", help="only this tenant")
    al.add_argument("--format", choices=("table", "json"), default="table")
    al.add_argument("--config", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    al.add_argument("--redis-url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    ap.set_defaults(func=run)


async def _alerts(url: str, prefix: str, start: float, end: float) -> tuple[list, dict]:
    import redis.asyncio as aioredis

    from tokenyard.gateway.spend.alerts import outbox_state, read_alerts
    client = aioredis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    try:
        return await read_alerts(client, prefix, start, end), await outbox_state(client, prefix)
    finally:
        await client.aclose()


def _alerts_table(alerts: list[dict], outbox: dict) -> str:
    from tokenyard.gateway.spend import reports
    from tokenyard.policies import format_money
    head = ("time (UTC)", "tenant", "budget", "period", "at", "spent", "limit", "at_limit", "id")
    rows = [(reports.iso(a["time"]), a["tenant"], a["budget"], f"{a['period']} {a['period_start']}",
             f"{a['threshold_pct']}%", format_money(a["spent_micros"]), format_money(a["limit_micros"]),
             a["at_limit"], a["id"]) for a in alerts]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *rows)]
    lines.append(f"{len(alerts)} alert(s); webhook outbox: {outbox['pending']} waiting, {outbox['dead']} given up")
    return "\n".join(lines) + "\n"


async def _report(url: str, prefix: str, tenant: str | None, start: float, end: float,
                  group_by: list[str]) -> tuple[list, dict]:
    import redis.asyncio as aioredis

    from tokenyard.gateway.routes.spend_queries import read_report
    from tokenyard.gateway.spend import reports, store
    client = aioredis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=10)
    try:
        tenants = [tenant] if tenant else await store.all_tenants(client, prefix)
        data, total, _, _ = await read_report(client, prefix, tenants, *reports.hour_range(start, end), group_by)
    finally:
        await client.aclose()
    return data, total


def run(args: argparse.Namespace) -> int:
    import redis

    from tokenyard.cli.deployment_arg import load_or_exit
    from tokenyard.gateway.edge.errors import BadRequest
    from tokenyard.gateway.spend import reports
    from tokenyard.gateway.store.embedded_redis import command_redis_url
    if args.spend_command == "alerts":
        return run_alerts(args)
    try:
        group_by = reports.parse_group_by(args.by)
        start, end = _window(args)
    except ValueError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2
    dep = load_or_exit(args.config)
    if start >= end:
        print("tokenyard: --since must be before --until", file=sys.stderr)
        return 2
    try:
        with command_redis_url(args.redis_url, dep.redis_url, dep.redis_dir) as url:
            data, total = asyncio.run(_report(url, dep.redis_prefix, args.tenant, start, end, group_by))
    except (redis.RedisError, OSError) as e:
        print(f"tokenyard: redis: {e}", file=sys.stderr)
        return 1
    except BadRequest as e:     # a stream-sourced grouping over too many records
        print(f"tokenyard: {e.message}", file=sys.stderr)
        return 2
    if args.format == "csv":
        sys.stdout.write(reports.to_csv(data, group_by))
    elif args.format == "json":
        print(json.dumps({"start": reports.iso(start), "end": reports.iso(end), "group_by": group_by,
                          "baseline_engine": dep.baseline_engine, "data": data, "total": total}, indent=2))
    else:
        print(f"spend {reports.iso(start)} .. {reports.iso(end)} (whole hours, UTC); money in currency units; "
              f"savings vs {dep.baseline_engine}")
        sys.stdout.write(reports.table(data, group_by, total))
    return 0


def _window(args: argparse.Namespace) -> tuple[float, float]:
    """(start, end) from --since and --until (ValueError names what is wrong)."""
    from tokenyard.gateway.spend import reports
    now = time.time()
    end = reports.parse_time(args.until) if args.until else now
    return reports.parse_since(args.since, now), end


def run_alerts(args: argparse.Namespace) -> int:
    import redis

    from tokenyard.cli.deployment_arg import load_or_exit
    from tokenyard.gateway.spend import reports
    from tokenyard.gateway.store.embedded_redis import command_redis_url
    try:
        start, end = _window(args)
    except ValueError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2
    dep = load_or_exit(args.config)
    try:
        with command_redis_url(args.redis_url, dep.redis_url, dep.redis_dir) as url:
            alerts, outbox = asyncio.run(_alerts(url, dep.redis_prefix, start, end))
    except (redis.RedisError, OSError) as e:
        print(f"tokenyard: redis: {e}", file=sys.stderr)
        return 1
    if args.tenant:
        alerts = [a for a in alerts if a.get("tenant") == args.tenant]
    if args.format == "json":
        print(json.dumps({"start": reports.iso(start), "end": reports.iso(end), "alerts": alerts,
                          "outbox": outbox}, indent=2, ensure_ascii=False))
    else:
        sys.stdout.write(_alerts_table(alerts, outbox))
    return 0
