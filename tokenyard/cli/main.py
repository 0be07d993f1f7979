"""The `tokenyard` command.

    tokenyard serve      the HTTP gateway (OpenAI-compatible) over the deployment's engines
    tokenyard keys       create, list and revoke API keys
    tokenyard spend      spend reports from the ledger (`tokenyard spend report --by model --since 7d`)
    tokenyard policy     routing policies in Redis: apply, show, history, rollback, simulate, validate
    tokenyard router     train / eval the learned router behind model "auto"
    tokenyard quantize   write an int8/int4 weight-only quantised checkpoint
    tokenyard engine     one engine as a replica process (`tokenyard engine serve --engine NAME --port P`)
    tokenyard bench      serving benchmarks over HTTP (`tokenyard bench serve --scenario ...`)
    tokenyard generate   stream one completion from a checkpoint to the terminal
    tokenyard demo       train / eval / plot the demo model pair
"""
from __future__ import annotations

import argparse
import sys


def _serve(args: argparse.Namespace) -> int:
    from tokenyard.cli.deployment_arg import UsageError, load_or_exit
    from tokenyard.gateway.config.deployment import DeploymentError, apply_env
    from tokenyard.gateway.http.server import serve

    try:
        dep = apply_env(load_or_exit(args.config))
    except DeploymentError as e:        # a bad value in the environment (TOKENYARD_GIL_SWITCH_MS)
        raise UsageError(str(e)) from None
    if args.host is not None:
        dep.host = args.host
    if args.port is not None:
        dep.port = args.port
    from tokenyard.gateway.state import StartupError
    try:
        return serve(dep)
    except StartupError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tokenyard", description="Tokenyard: an LLM serving gateway")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the gateway (default deployment: deploy/default.yaml)")
    serve.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    serve.add_argument("--host", help="listen address (overrides server.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides server.port)")
    serve.set_defaults(func=_serve)
    # --- keys ---
    from tokenyard.cli import keys as keys_cli
    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_cli.add_arguments(keys)
    # --- end keys ---
    # --- spend ---
    from tokenyard.cli import spend as spend_cli
    spend = sub.add_parser("spend", help="spend reports from the ledger (`tokenyard spend report --by model`)")
    spend_cli.add_arguments(spend)
    # --- end spend ---
    # --- policy ---
    from tokenyard.cli import policy as policy_cli
    pol = sub.add_parser("policy", help="routing policies: apply, show, history, rollback, simulate, validate")
    policy_cli.add_arguments(pol)
    # --- end policy ---
    from tokenyard.engines.serving import generate_cli
    gen = sub.add_parser("generate", help="stream a completion from a checkpoint to the terminal")
    generate_cli.add_arguments(gen)
    gen.set_defaults(func=generate_cli.run)
    from tokenyard.engines.quant import quantize_cli
    quant = sub.add_parser("quantize", help="write an int8/int4 weight-only quantised checkpoint")
    quantize_cli.add_arguments(quant)
    quant.set_defaults(func=quantize_cli.run)
    from tokenyard.demo import cli as demo_cli
    demo = sub.add_parser("demo", help="train, evaluate and plot the demo model pair")
    demo_cli.add_arguments(demo)
    # --- bench ---
    from tokenyard.bench import serve_cli
    bench = sub.add_parser("bench", help="benchmarks: `tokenyard bench serve` drives servers over HTTP")
    serve_cli.add_arguments(bench)
    bench.set_defaults(func=serve_cli.run)
    # --- end bench ---
    # --- engine replicas ---
    from tokenyard.cli import engine as engine_cli
    engine = sub.add_parser("engine", help="run one engine as a replica process (`tokenyard engine serve`)")
    engine_cli.add_arguments(engine)
    # --- end engine ---
    # --- router ---
    from tokenyard.router_models.training import cli as router_cli
    router = sub.add_parser("router", help="train and evaluate the learned router for model auto")
    router_cli.add_arguments(router)
    # --- end router ---
    args = ap.parse_args(argv)
    from tokenyard.cli.deployment_arg import UsageError
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
