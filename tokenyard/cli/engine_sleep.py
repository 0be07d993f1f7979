"""`tokenyard engine sleep` and `tokenyard engine wake`: a replica to sleep and back (docs/scaling.md).

    tokenyard engine sleep --gateway http://gw:8000 --engine demo-large --replica 0 [--level 1] [--drain-timeout-s 30]
    tokenyard engine wake  --gateway http://gw:8000 --engine demo-large --replica 0
    tokenyard engine sleep --url http://replica:9000 --level 2          # a replica directly, no gateway

Through a gateway the admin API is called with an admin key (--key, else TOKENYARD_ADMIN_KEY);
a replica's own control API (`tokenyard engine serve`, internal: no key) with --url. Prints the
answer as JSON; exit status 0 when it was done, 1 when the gateway or replica refused (its error
printed), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
import urllib.request
from typing import Any

from tokenyard.cli.admin_call import send


def add_parsers(sub: Any) -> None:
    for action, help_ in (("sleep", "put a replica to sleep (level 1: free its KV cache; 2: drop its weights too)"),
                          ("wake", "wake a sleeping replica; returns when it serves again")):
        p = sub.add_parser(action, help=help_)
        p.add_argument("--gateway", help="gateway base URL (the admin API; needs an admin key)")
        p.add_argument("--engine", help="engine name (with --gateway)")
        p.add_argument("--replica", help="replica index in engines.NAME.replicas, or its label (with --gateway)")
        p.add_argument("--key", help="admin key (default: TOKENYARD_ADMIN_KEY)")
        p.add_argument("--url", help="a replica's base URL instead of a gateway")
        p.add_argument("--timeout-s", type=float, default=660.0, help="how long to wait for the answer")
        if action == "sleep":
            p.add_argument("--level", type=int, default=1, choices=(1, 2), help="sleep level (default 1)")
            p.add_argument("--drain-timeout-s", type=float, default=30.0,
                           help="how long requests in flight may take before the sleep is refused (default 30)")
        p.set_defaults(func=run, sleep_action=action)


def run(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.sleep_action == "sleep":
        body = {"level": args.level, "drain_timeout_s": args.drain_timeout_s}
    headers = {"Content-Type": "application/json"}
    if args.url and not args.gateway:
        url = f"{args.url.rstrip('/')}/v1/engine/{args.sleep_action}"
    elif args.gateway and not args.url:
        if not args.engine or args.replica is None:
            print("tokenyard: --gateway needs --engine and --replica", file=sys.stderr)
            return 2
        key = args.key or os.environ.get("TOKENYARD_ADMIN_KEY")
        if not key:
            print("tokenyard: an admin key is needed: --key or TOKENYARD_ADMIN_KEY", file=sys.stderr)
            return 2
        headers["Authorization"] = f"Bearer {key}"
        quote = urllib.parse.quote
        url = (f"{args.gateway.rstrip('/')}/admin/engines/{quote(args.engine, safe='')}/replicas/"
               f"{quote(args.replica, safe='')}/{args.sleep_action}")
    else:
        print("tokenyard: give either --gateway (with --engine and --replica) or --url", file=sys.stderr)
        return 2
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    return send(req, args.sleep_action, args.timeout_s)
