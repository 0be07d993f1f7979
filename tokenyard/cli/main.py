"""The `tokenyard` command.

    tokenyard serve      the HTTP gateway (OpenAI-compatible) over the deployment's engines
    tokenyard keys       create, list and revoke API keys
    tokenyard spend      spend reports from the ledger (`tokenyard spend report --by model --since 7d`)
    tokenyard policy     routing policies in Redis: apply, show, history, rollback, simulate, validate
    tokenyard router     train / eval / publish / shadow-report the learned router behind model "auto"
    tokenyard quantize   write an int8/int4 weight-only quantised checkpoint
    tokenyard engine     one engine as a replica process (`tokenyard engine serve --engine NAME --port P`)
    tokenyard bench      serving benchmarks over HTTP (`tokenyard bench serve --scenario ...`), fleet simulation
                         (`tokenyard bench fleet`)
    tokenyard generate   stream one completion from a checkpoint to the terminal
    tokenyard demo       train / eval / plot the demo model pair

Start-up stays cheap: a command's module (and with it torch, the gateway, scikit-learn...) is imported
only when that command runs, so `tokenyard --help`, `--version` and `tokenyard keys ...` never load
torch (tests/packaging/test_cli_startup.py).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections import namedtuple

# help: the line in `tokenyard --help`; module: holds add_arguments(parser), imported only when this command
# runs; run: the module's function to run (None: add_arguments sets func itself). A namedtuple, not a
# dataclass: importing dataclasses alone costs the start-up of every command a few ms.
Command = namedtuple("Command", "help module run", defaults=(None,))


COMMANDS: dict[str, Command] = {
    "serve": Command("start the gateway (default deployment: the packaged tokenyard/deploy/default.yaml)",
                     "tokenyard.cli.serve"),
    "keys": Command("create, list and revoke API keys", "tokenyard.cli.keys"),
    "spend": Command("spend reports from the ledger (`tokenyard spend report --by model`)", "tokenyard.cli.spend"),
    "policy": Command("routing policies: apply, show, history, rollback, simulate, validate", "tokenyard.cli.policy"),
    "generate": Command("stream a completion from a checkpoint to the terminal",
                        "tokenyard.engines.serving.generate_cli", "run"),
    "quantize": Command("write an int8/int4 weight-only quantised checkpoint", "tokenyard.engines.quant.quantize_cli", "run"),
    "demo": Command("train, evaluate and plot the demo model pair", "tokenyard.demo.cli"),
    "bench": Command("benchmarks: `tokenyard bench serve` drives servers over HTTP, `bench fleet` simulates a fleet",
                     "tokenyard.bench.serve_cli", "run"),
    "engine": Command("run one engine as a replica process (`tokenyard engine serve`)", "tokenyard.cli.engine"),
    "router": Command("train, evaluate, publish and shadow the learned router for model auto", "tokenyard.cli.router"),
}


class _Version(argparse.Action):
    """--version, read from the installed metadata only when asked (importlib.metadata costs ~20 ms)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        import tokenyard
        print(f"tokenyard {tokenyard.__version__}")
        parser.exit()


def _chosen(argv: list[str]) -> str | None:
    """The command named on the line: the first word that is not an option (top-level options take no value)."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Every command is listed; only the one on the line gets its arguments (and its imports)."""
    ap = argparse.ArgumentParser(prog="tokenyard", description="Tokenyard: an LLM serving gateway")
    ap.add_argument("--version", action=_Version)
    sub = ap.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, cmd in COMMANDS.items():
        parser = sub.add_parser(name, help=cmd.help)
        if name != chosen:
            continue
        module = importlib.import_module(cmd.module)
        module.add_arguments(parser)
        if cmd.run is not None:
            parser.set_defaults(func=getattr(module, cmd.run))
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    from tokenyard.cli.usage_error import UsageError
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tokenyard: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
