"""One gateway worker process (`server.workers` > 1): the whole gateway (HTTP, auth, limits, routing,
spend) on a listening socket it shares with the other workers, its engines linked to the cores the
supervisor started (tokenyard/gateway/server/supervisor.py). Started by the supervisor, not by hand:

    python -m tokenyard.gateway.server.worker --fd N --deployment PATH --index I

PATH holds the pickled Deployment the supervisor prepared: Redis's URL, the development key and
`engine_sockets` (engine name -> its core's Unix socket) filled in. SIGTERM drains as a single gateway
does (tokenyard/gateway/server/server.py): /ready turns false, requests in flight finish, then it exits.
"""
from __future__ import annotations

import argparse
import logging
import pickle
import signal
import socket
import sys
from pathlib import Path

log = logging.getLogger("tokenyard.server")


def run_worker(sock: socket.socket, dep) -> int:
    from tokenyard.gateway.server.app import create_app
    from tokenyard.gateway.server.connection_guard import fit_max_connections, raise_fd_limit
    from tokenyard.gateway.server.server import DrainingServer, setup_logging, uvicorn_config

    setup_logging()
    sys.setswitchinterval(dep.gil_switch_interval_ms / 1000.0)
    soft, _ = raise_fd_limit()
    dep.connections.max_connections = fit_max_connections(dep.connections.max_connections, soft)
    app = create_app(dep, dev_key=dep.auth.dev_key)
    server = DrainingServer(uvicorn_config(app, dep.connections, lifespan="on"), app.state.gateway, dep.drain_grace_s)
    try:
        server.run(sockets=[sock])
    finally:
        for h in logging.getLogger("tokenyard.access").handlers:
            h.flush()
    return 0 if server.started else 1


def die_with_parent() -> None:
    """SIGTERM this process when the supervisor dies (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing): a
    worker in a session of its own would otherwise outlive a supervisor that was killed."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description="a gateway worker; started by `tokenyard serve` with server.workers > 1")
    ap.add_argument("--fd", type=int, required=True, help="the inherited listening socket")
    ap.add_argument("--deployment", required=True, help="the pickled Deployment the supervisor wrote")
    ap.add_argument("--index", type=int, default=0)
    args = ap.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the group: the supervisor sends SIGTERM
    die_with_parent()
    dep = pickle.loads(Path(args.deployment).read_bytes())
    sock = socket.socket(fileno=args.fd)
    sys.exit(run_worker(sock, dep))


if __name__ == "__main__":
    main()
