"""`tokenyard serve`: the HTTP gateway over the deployment's engines.

Without --config it serves the deployment shipped in the package (tokenyard/deploy/default.yaml: the demo
pair and SmolLM2-135M in-process, loopback only, an embedded Redis under ~/.tokenyard).
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    ap.add_argument("--host", help="listen address (overrides server.host)")
    ap.add_argument("--port", type=int, help="listen port (overrides server.port)")
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenyard.cli.deployment_arg import UsageError, load_or_exit
    from tokenyard.gateway.config.deployment import DeploymentError, apply_env
    from tokenyard.gateway.server.server import serve
    from tokenyard.gateway.state import StartupError

    try:
        dep = apply_env(load_or_exit(args.config))
    except DeploymentError as e:        # a bad value in the environment (TOKENYARD_GIL_SWITCH_MS)
        raise UsageError(str(e)) from None
    if args.host is not None:
        dep.host = args.host
    if args.port is not None:
        dep.port = args.port
    try:
        return serve(dep)
    except StartupError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2
