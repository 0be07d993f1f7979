"""`tokenyard engine serve`: one engine of a deployment as a replica process.

    tokenyard engine serve --engine demo-large --port 9000 [--config deploy.yaml] [--host 0.0.0.0]
    tokenyard engine sleep|wake ...       a replica to sleep and back (tokenyard/cli/engine_sleep.py)
    tokenyard engine adapters list|load|unload ...   LoRA adapters at run time (tokenyard/cli/engine_adapters.py)

The engine is built from the deployment's engine spec (type, model and engine keys; its
`replicas`/`replica_pool`/`prices` keys are the gateway's business and are ignored here) and
served by tokenyard/engines/serving/replica_server.py. Gateways list the replica under `engines.NAME.replicas`.

Disaggregated serving: `--role prefill` or `--role decode` (default: the engine's `role` key, else
`both`, today's replica) makes the replica one side of a KV hand-over (engines/serving/kv_handover.py,
docs/kv_transfer.md); a decode replica takes KV payloads over TCP on `--kv-port` (0: any free port).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import threading


def add_arguments(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="engine_command", required=True)
    serve = sub.add_parser("serve", help="serve one engine of the deployment as a replica over internal HTTP")
    serve.add_argument("--engine", required=True, help="engine name under `engines` in the deployment file")
    serve.add_argument("--config", help="deployment YAML file (default: the packaged tokenyard/deploy/default.yaml)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, required=True, help="listen port")
    serve.add_argument("--drain-grace-s", type=float, default=None,
                       help="on SIGTERM, how long requests in flight may take (default: server.drain_grace_s)")
    serve.add_argument("--role", choices=("prefill", "decode", "both"), default=None,
                       help="disaggregated serving role (default: the engine's `role` key, else both)")
    serve.add_argument("--kv-port", type=int, default=0,
                       help="decode role: TCP port of the KV receiver (default 0: any free port, in /v1/engine/stats)")
    serve.set_defaults(func=run)
    from tokenyard.cli.engine_sleep import add_parsers
    add_parsers(sub)      # sleep, wake
    from tokenyard.cli.engine_adapters import add_parser
    add_parser(sub)       # adapters list|load|unload


# What serve() imports once the engine is up: the HTTP server and its protocol (uvicorn picks h11 or
# httptools and asyncio or uvloop by what is installed, hence the list; a missing one is skipped).
_SERVER_MODULES = ("uvicorn", "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl",
                   "uvicorn.protocols.http.httptools_impl", "uvicorn.loops.uvloop", "starlette.applications",
                   "starlette.requests", "starlette.responses", "starlette.routing")


def _import_server_stack() -> None:
    """Import the server's modules on a thread while this process waits for its engine core's hello:
    the core spends ~1.4 s importing torch on one core, and these ~35 ms on the other would otherwise
    follow it on the way to ready (and lengthen the rest between the core's warm-up request and the
    first client request, which costs that request on some VMs: bench/RESULTS.md, "Ready with margin")."""
    for name in _SERVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def run(args: argparse.Namespace) -> int:
    from tokenyard.cli.deployment_arg import UsageError, load_or_exit
    from tokenyard.gateway.config.deployment import DeploymentError, apply_env

    try:
        dep = apply_env(load_or_exit(args.config))
    except DeploymentError as e:        # a bad value in the environment (TOKENYARD_GIL_SWITCH_MS)
        raise UsageError(str(e)) from None
    spec = dep.engines.get(args.engine)
    if spec is None:
        print(f"tokenyard: no engine {args.engine!r} in the deployment (known: {', '.join(dep.engines)})",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tokenyard.engines.core.startup_phases import StartupPhases, process_age_s
    from tokenyard.engines.runtime.async_engine import AsyncEngine
    from tokenyard.engines.serving.engine_process import EngineProcess
    from tokenyard.engines.serving.replica_server import serve
    from tokenyard.gateway.backends.engine_pool import _build, _recipe, tokenizer_fingerprint
    # a replica's event loop and its engine's step thread share the GIL as a gateway's do; or the
    # engine steps in a process of its own (server.engine_process), as behind a gateway
    sys.setswitchinterval(dep.gil_switch_interval_ms / 1000.0)
    # Start-up phases (tokenyard_engine_startup_seconds): until here, the interpreter, the imports
    # and the deployment file; then the engine's own phases; serve() adds warm_up and closes at ready.
    startup = StartupPhases()
    startup.add("imports", process_age_s() or 0.0)
    role = args.role or spec.role
    # server.engine_process; auto (None): a torch engine does (a replica serves no embeddings), a mock does not;
    # a prefill or decode replica keeps its engine here (the KV hand-over reads and writes its cache tensors)
    own = (spec.type == "torch" and role == "both") if dep.engine_process is None else dep.engine_process
    if role != "both" and own:
        print(f"tokenyard: role {role} needs the engine in this process (server.engine_process false): the KV "
              f"hand-over reads and writes its cache tensors", file=sys.stderr)
        return 2
    if own:
        threading.Thread(target=_import_server_stack, name="server-imports", daemon=True).start()
    engine = EngineProcess(_recipe(spec), spec.name) if own else AsyncEngine(_build(spec), spec.name)
    handover = None
    if role != "both":
        from tokenyard.engines.serving.kv_handover import KVHandover
        handover = KVHandover(engine, role)
        try:
            handover.check_engine()
        except ValueError as e:
            print(f"tokenyard: engine {spec.name}: {e}", file=sys.stderr)
            return 2
    startup.merge(getattr(engine, "startup_phases", None) or {})    # an engine process keeps its own: other
    grace = dep.drain_grace_s if args.drain_grace_s is None else args.drain_grace_s
    return serve(engine, args.host, args.port, grace, tokenizer_fingerprint(spec.model), startup=startup,
                 handover=handover, kv_port=args.kv_port)
