"""`tokenyard keys create|list|revoke`: API keys in the deployment's Redis.

    tokenyard keys create --tenant acme [--admin] [--name ci] [--priority batch] [--rpm 60] [--tpm 100000]
    tokenyard keys list [--tenant acme] [--json]
    tokenyard keys revoke KEY_ID

The key is printed once, by `create`, and never stored (only its SHA-256). Redis is found like
the gateway finds it: --redis-url, else REDIS_URL, else the deployment's `redis_url`, else the
embedded redis-server under `redis_dir` (started for the command if the gateway is not running,
then stopped). Revocation is pushed to every running gateway through pub/sub.
"""
from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Iterator

from tokenyard.gateway.auth.api_keys import PRIORITIES, KeySpecError, KeyStore


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    ap.add_argument("--redis-url", help="Redis to use (default: REDIS_URL, then the deployment's)")
    sub = ap.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="make a key and print it once")
    create.add_argument("--tenant", required=True, help="the tenant the key belongs to (its limits are shared)")
    create.add_argument("--name", default="", help="a label for the key")
    create.add_argument("--admin", action="store_true", help="an admin key (admin endpoints, all tenants' reports)")
    create.add_argument("--priority", choices=PRIORITIES, default="interactive", help="admission class")
    create.add_argument("--rpm", type=int,
                        help="this key's own requests per rate window; a policy rate class can only tighten it "
                        "(default: the deployment's rate_limits.requests; 0: no limit of its own)")
    create.add_argument("--tpm", type=int, help="this key's own tokens per rate window; a policy rate class can only tighten it "
                        "(default: the deployment's rate_limits.tokens; 0: no limit of its own)")
    create.add_argument("--max-concurrent", type=int,
                        help="requests queued or running per gateway (default: admission.max_concurrent_per_tenant)")
    create.add_argument("--adapters", help="LoRA adapters the key may use, comma-separated ENGINE:ADAPTER, ENGINE:* "
                                           "or * (default: every adapter; '' for none); its tenant's list applies too")
    lst = sub.add_parser("list", help="list keys (never the keys themselves)")
    lst.add_argument("--tenant", help="only this tenant's keys")
    lst.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    revoke = sub.add_parser("revoke", help="revoke a key by its id (as `keys list` shows it)")
    revoke.add_argument("key_id")
    ap.set_defaults(func=run)


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[KeyStore]:
    import redis

    from tokenyard.cli.deployment_arg import load_or_exit
    from tokenyard.gateway.store.embedded_redis import command_redis_url
    dep = load_or_exit(args.config)
    with command_redis_url(args.redis_url, dep.redis_url, dep.redis_dir) as url:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=5)
        try:
            yield KeyStore(client, dep.redis_prefix)
        finally:
            client.close()


def _when(ts: float | None) -> str:
    return "" if ts is None else datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def run(args: argparse.Namespace) -> int:
    import redis

    try:
        with _store(args) as store:
            if args.keys_command == "create":
                key, rec = store.create(args.tenant, name=args.name, role="admin" if args.admin else "user",
                                        priority=args.priority, rpm=args.rpm, tpm=args.tpm,
                                        max_concurrent=args.max_concurrent,
                                        adapters=None if args.adapters is None else
                                        [a.strip() for a in args.adapters.split(",") if a.strip()])
                print(key)
                print(f"key id {rec.key_id}, tenant {rec.tenant}, role {rec.role}, priority {rec.priority} "
                      f"(the key is shown only now; keep it somewhere safe)", file=sys.stderr)
                return 0
            if args.keys_command == "list":
                records = store.list(args.tenant)
                if args.json:
                    for rec in records:
                        print(json.dumps(rec.public()))
                    return 0
                cols = ("key_id", "tenant", "name", "role", "priority", "rpm", "tpm", "created", "revoked")
                rows = [[rec.key_id, rec.tenant, rec.name, rec.role, rec.priority,
                         "default" if rec.rpm is None else str(rec.rpm), "default" if rec.tpm is None else str(rec.tpm),
                         _when(rec.created), _when(rec.revoked)] for rec in records]
                widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
                for row in [list(cols), *rows]:
                    print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
                return 0
            rec = store.revoke(args.key_id)
            if rec is None:
                print(f"tokenyard: no key with id {args.key_id}", file=sys.stderr)
                return 1
            print(f"revoked {rec.key_id} (tenant {rec.tenant}) at {_when(rec.revoked)}")
            return 0
    except KeySpecError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2
    except redis.RedisError as e:
        print(f"tokenyard: redis: {e}", file=sys.stderr)
        return 1
