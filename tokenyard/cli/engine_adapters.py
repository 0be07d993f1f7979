"""`tokenyard engine adapters list|load|unload`: an engine's LoRA adapters at run time (docs/engine.md).

    tokenyard engine adapters list   --gateway http://gw:8000 --engine demo-large
    tokenyard engine adapters load   --gateway http://gw:8000 --engine demo-large --name sql --path /srv/adapters/sql
    tokenyard engine adapters unload --gateway http://gw:8000 --engine demo-large --name sql
    tokenyard engine adapters load   --url http://replica:9000 --name sql --path /srv/adapters/sql   # one replica

Through a gateway the admin API is called (GET/POST/DELETE /admin/engines/{engine}/adapters) with an admin
key (--key, else TOKENYARD_ADMIN_KEY): the path must lie in the engine's lora_roots, the change is audited,
and a replica pool loads it on every replica. --url talks to one replica's internal API instead (no key, no
lora_roots check: for operators on the replica's host). Prints the answer as JSON; exit status 0 when it
was done, 1 when refused (the error printed), 2 for bad arguments.
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("adapters", help="list, load or unload an engine's LoRA adapters while it serves")
    p.add_argument("adapters_action", choices=("list", "load", "unload"))
    p.add_argument("--gateway", help="gateway base URL (the admin API; needs an admin key)")
    p.add_argument("--engine", help="engine name (with --gateway)")
    p.add_argument("--key", help="admin key (default: TOKENYARD_ADMIN_KEY)")
    p.add_argument("--url", help="a replica's base URL instead of a gateway")
    p.add_argument("--name", help="the adapter's name (load, unload): requests name it as ENGINE:NAME")
    p.add_argument("--path", help="the adapter's folder (load): adapter_config.json + adapter_model.safetensors")
    p.add_argument("--timeout-s", type=float, default=120.0, help="how long to wait for the answer")
    p.set_defaults(func=run)


def _request(args: argparse.Namespace) -> urllib.request.Request | str:
    """The HTTP request to send, or why the arguments do not make one."""
    action = args.adapters_action
    if action in ("load", "unload") and not args.name:
        return f"{action} needs --name"
    if action == "load" and not args.path:
        return "load needs --path"
    quote = urllib.parse.quote
    headers = {"Content-Type": "application/json"}
    body: dict[str, Any] | None = {"name": args.name, "path": args.path} if action == "load" else None
    if args.url and not args.gateway:
        base = f"{args.url.rstrip('/')}/v1/engine/adapters"
        if action == "list":
            return urllib.request.Request(base, headers=headers, method="GET")
        body = body or {"name": args.name}
        return urllib.request.Request(f"{base}/{action}", data=json.dumps(body).encode(), headers=headers,
                                      method="POST")
    if not args.gateway or args.url or not args.engine:
        return "give either --gateway with --engine, or --url"
    key = args.key or os.environ.get("TOKENYARD_ADMIN_KEY")
    if not key:
        return "an admin key is needed: --key or TOKENYARD_ADMIN_KEY"
    headers["Authorization"] = f"Bearer {key}"
    base = f"{args.gateway.rstrip('/')}/admin/engines/{quote(args.engine, safe='')}/adapters"
    if action == "list":
        return urllib.request.Request(base, headers=headers, method="GET")
    if action == "load":
        return urllib.request.Request(base, data=json.dumps(body).encode(), headers=headers, method="POST")
    return urllib.request.Request(f"{base}/{quote(args.name, safe='')}", headers=headers, method="DELETE")


def run(args: argparse.Namespace) -> int:
    req = _request(args)
    if isinstance(req, str):
        print(f"tokenyard: {req}", file=sys.stderr)
        return 2
    return send(req, f"adapters {args.adapters_action}", args.timeout_s)
