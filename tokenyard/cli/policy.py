"""`tokenyard policy`: the routing policy of record in the deployment's Redis.

    tokenyard policy apply FILE [--author NAME]     validate, store as a new version, announce
    tokenyard policy show [--format yaml|json]      the current version (yaml: the document as applied)
    tokenyard policy history [--json]               every version, newest first (--diff: with diffs)
    tokenyard policy rollback N [--author NAME]     a new version with version N's exact document
    tokenyard policy simulate FILE [--since 7d] [--until T] [--limit N] [--tenant T] [--json]
    tokenyard policy validate FILE                  problems with line, column, key path (exit 1 if any)

Works on Redis directly, like `tokenyard keys` and `tokenyard spend` (--redis-url, else
REDIS_URL, else the deployment's redis_url, else the embedded redis-server under redis_dir);
running gateways pick a new version up at once through pub/sub. Redis access is the operator's
credential here, so the author recorded is --author (default: "cli:" + the login name); through
HTTP, PUT /admin/policy records the admin key's name instead. `validate` needs no Redis.
Engines named by the policy are checked against the deployment file given with --config.
"""
from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
import time
from pathlib import Path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    ap.add_argument("--redis-url", help="Redis to use (default: REDIS_URL, then the deployment's)")
    sub = ap.add_subparsers(dest="policy_command", required=True)
    apply = sub.add_parser("apply", help="validate FILE and make it the current version")
    apply.add_argument("file")
    apply.add_argument("--author", help="recorded as who applied it (default: cli:<login name>)")
    show = sub.add_parser("show", help="print the current version")
    show.add_argument("--format", choices=("yaml", "json"), default="yaml")
    hist = sub.add_parser("history", help="list every version, newest first")
    hist.add_argument("--json", action="store_true", help="JSON lines (with documents and diffs)")
    hist.add_argument("--diff", action="store_true", help="print each version's diff")
    rb = sub.add_parser("rollback", help="restore version N's document as a new version")
    rb.add_argument("version", type=int)
    rb.add_argument("--author", help="recorded as who rolled back (default: cli:<login name>)")
    sim = sub.add_parser("simulate", help="replay recorded traffic under FILE vs the current policy")
    sim.add_argument("file")
    sim.add_argument("--since", default="7d", help="start: a span before now (7d, 12h), unix seconds or ISO 8601")
    sim.add_argument("--until", help="end (default: now)")
    sim.add_argument("--limit", type=int, default=10_000, help="most records replayed (newest first)")
    sim.add_argument("--tenant", help="one tenant's traffic only")
    sim.add_argument("--json", action="store_true", help="the full comparison as JSON")
    val = sub.add_parser("validate", help="check FILE; exit 1 with every problem when invalid")
    val.add_argument("file")
    ap.set_defaults(func=run)


def _author(args: argparse.Namespace) -> str:
    if getattr(args, "author", None):
        return args.author
    try:
        return "cli:" + getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in a container
        return "cli"


def _read(path: str) -> str:
    return Path(path).read_text(encoding="utf-8")


async def _run(args: argparse.Namespace, url: str, dep) -> int:
    import redis.asyncio as aioredis

    from tokenyard.gateway.policy.store import NoSuchVersion, PolicyStore
    from tokenyard.gateway.routes.policy_admin import check_document, compare_policies, recorded_traffic
    from tokenyard.gateway.spend.reports import parse_since, parse_time
    from tokenyard.gateway.state import load_learned_router
    from tokenyard.policies import PolicyError

    client = aioredis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    store = PolicyStore(client, dep.redis_prefix)
    engines = list(dep.engines)
    try:
        cmd = args.policy_command
        if cmd == "apply":
            try:
                v, applied = await store.apply(_read(args.file), _author(args), engines,
                                               note=f"applied from {Path(args.file).name}")
            except PolicyError as e:
                print(f"tokenyard: {args.file}: {e}", file=sys.stderr)
                return 1
            if not applied:
                print(f"unchanged: {args.file} means version {v.version} (hash {v.hash[:12]}); nothing stored")
                return 0
            print(f"applied version {v.version} (hash {v.hash[:12]}) by {v.author}")
            print(v.diff, end="")
            return 0
        if cmd == "show":
            v = await store.current()
            if v is None:
                print("no policy applied: the built-in default (the deployment's routing) is in force",
                      file=sys.stderr)
                return 1
            if args.format == "json":
                from tokenyard.policies import policy_to_dict
                print(json.dumps({**v.to_dict(), "policy": policy_to_dict(v.policy())}, indent=2))
            else:
                print(f"# version {v.version}, hash {v.hash}, applied by {v.author} at {v.applied_at.isoformat()}")
                print(v.document, end="" if v.document.endswith("\n") else "\n")
            return 0
        if cmd == "history":
            current = await store.current_number()
            for v in await store.history():
                if args.json:
                    print(json.dumps(v.to_dict()))
                    continue
                mark = "*" if v.version == current else " "
                print(f"{mark} {v.version:>4}  {v.applied_at.strftime('%Y-%m-%d %H:%M:%SZ')}  {v.hash[:12]}  "
                      f"{v.author}  {v.note}".rstrip())
                if args.diff and v.diff:
                    print(v.diff, end="")
            return 0
        if cmd == "rollback":
            try:
                v = await store.rollback(args.version, _author(args), engines)
            except (NoSuchVersion, PolicyError) as e:
                print(f"tokenyard: {e}", file=sys.stderr)
                return 1
            print(f"version {v.version} restores version {args.version} (hash {v.hash[:12]}) by {v.author}")
            return 0
        if cmd == "simulate":
            try:
                proposed = check_document(_read(args.file), engines)
            except PolicyError as e:
                print(f"tokenyard: {args.file}: {e}", file=sys.stderr)
                return 1
            now = time.time()
            end = parse_time(args.until) if args.until else now
            start = parse_since(args.since, now)
            cur = await store.current()
            traffic = await recorded_traffic(client, dep.redis_prefix, start, end, args.limit, args.tenant)
            result = compare_policies(cur.policy() if cur else None, proposed, traffic, load_learned_router(dep))
            if args.json:
                print(json.dumps(result, indent=2))
            elif result["text"] is not None:
                print(f"{len(traffic)} recorded requests; current = version {cur.version}, proposed = {args.file}")
                print(result["text"], end="")
            else:
                print(f"{len(traffic)} recorded requests; no policy in force; proposed:")
                print(json.dumps(result["proposed"], indent=2))
            return 0
    finally:
        await client.aclose()
    return 2


def run(args: argparse.Namespace) -> int:
    import redis

    from tokenyard.cli.deployment_arg import load_or_exit
    from tokenyard.gateway.store.embedded_redis import command_redis_url
    dep = load_or_exit(args.config)
    if args.policy_command == "validate":
        from tokenyard.gateway.routes.policy_admin import check_document
        from tokenyard.policies import PolicyError
        try:
            policy = check_document(_read(args.file), list(dep.engines))
        except PolicyError as e:
            print(f"{args.file}: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"tokenyard: {e}", file=sys.stderr)
            return 2
        from tokenyard.policies import policy_hash
        print(f"{args.file}: valid (hash {policy_hash(policy)})")
        return 0
    try:
        with command_redis_url(args.redis_url, dep.redis_url, dep.redis_dir) as url:
            return asyncio.run(_run(args, url, dep))
    except (redis.RedisError, OSError) as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 1
