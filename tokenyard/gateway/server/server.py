"""Run a gateway under uvicorn with graceful drain.

SIGTERM (or the first Ctrl-C) starts the drain: /ready turns false and new chat requests get
503 with Retry-After, while requests in flight keep running; as soon as none is left, or when
`server.drain_grace_s` has passed, uvicorn shuts down (closing idle connections, cancelling
whatever still runs), the engines stop and the access log is flushed. A second signal exits at
once. The process then exits with status 0.

Connections are guarded (tokenyard/gateway/server/connection_guard.py): deadlines on request heads and bodies, a
cap on open connections, 431 for oversized heads; the open-file limit is raised to the hard limit
at start, and the accept-error log is rate-limited.

With `server.workers` > 1 this process becomes a supervisor (tokenyard/gateway/server/supervisor.py): it
starts Redis (when embedded) and the engine cores, then the worker processes, each of which runs the
gateway below on the socket it hands them (tokenyard/gateway/server/worker.py).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from tokenyard.gateway.config.deployment import Connections, Deployment
from tokenyard.gateway.server.app import create_app
from tokenyard.gateway.server.connection_guard import (
    BACKLOG,
    QuietAcceptErrors,
    fit_max_connections,
    guarded_protocol,
    raise_fd_limit,
)
from tokenyard.gateway.store.embedded_redis import EmbeddedRedis

log = logging.getLogger("tokenyard.server")


def uvicorn_config(app, conn: Connections, **kw) -> uvicorn.Config:
    """uvicorn settings for a gateway app: the guarded h11 protocol and its limits."""
    return uvicorn.Config(app, http=guarded_protocol(conn), h11_max_incomplete_event_size=conn.max_header_bytes,
                          timeout_keep_alive=conn.keep_alive_s, backlog=BACKLOG, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=1, **kw)


class GuardedServer(uvicorn.Server):
    """uvicorn's server with the accept-error log rate-limited on its loop."""

    async def startup(self, sockets=None) -> None:
        self.accept_errors = QuietAcceptErrors()
        asyncio.get_running_loop().set_exception_handler(self.accept_errors)
        await super().startup(sockets)

    @property
    def connection_stats(self):
        return self.config.http_protocol_class.stats


class DrainingServer(GuardedServer):
    def __init__(self, config: uvicorn.Config, gateway, grace_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.grace_s = grace_s
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: only set flags; on_tick (every 0.1 s) acts on them. Unlike
        # uvicorn's own handler this does not record the signal, so it is not re-raised at exit.
        if self._drain_requested:
            self.should_exit = self.force_exit = True
        self._drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self.gateway.start_drain()
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace_s
        while self.gateway.in_progress > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.gateway.in_progress:
            log.warning("drain grace of %.1f s over; cutting %d request(s)", self.grace_s, self.gateway.in_progress)
        self.should_exit = True


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger("tokenyard.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _dev_key(dep: Deployment, announce) -> str | None:
    """The development admin key: the configured one, or one made (and shown) on the first start only."""
    import redis

    from tokenyard.gateway.auth.api_keys import KeyStore
    client = redis.Redis.from_url(dep.redis_url, socket_connect_timeout=2, socket_timeout=2)
    try:
        key, rec = KeyStore(client, dep.redis_prefix).ensure_dev_key(dep.auth.dev_key)
    except redis.RedisError as e:
        log.warning("redis at %s is not reachable (%s); only a configured dev key will work", dep.redis_url, e)
        key, rec = dep.auth.dev_key, None
    finally:
        client.close()
    if key:
        announce(f"tokenyard: development admin API key: {key}")
    elif rec is not None:
        announce(f"tokenyard: development admin key {rec.key_id} was printed on the first start; make another with "
                 f"`tokenyard keys create --tenant dev --admin`")
    return key


def serve(dep: Deployment, announce=lambda line: print(line, flush=True)) -> int:
    """Serve until SIGTERM / Ctrl-C has drained; `server.workers` > 1 hands over to the supervisor."""
    if dep.workers > 1 and dep.engine_process is False:
        from tokenyard.gateway.state import StartupError
        raise StartupError("server.workers > 1 shares one engine core per engine between the workers; "
                           "server.engine_process: false (an engine inside each worker) cannot go with it")
    setup_logging()
    # process-wide, so set here, where this process becomes a gateway (Deployment says why)
    sys.setswitchinterval(dep.gil_switch_interval_ms / 1000.0)
    soft, _ = raise_fd_limit()
    dep.connections.max_connections = fit_max_connections(dep.connections.max_connections, soft)
    embedded = None
    if not dep.redis_url:
        embedded = EmbeddedRedis(dep.redis_dir)
        dep.redis_url = embedded.start()
    try:
        dev_key = _dev_key(dep, announce)
        if dep.workers > 1:          # engine cores, then the workers (tokenyard/gateway/server/supervisor.py)
            from tokenyard.gateway.server.supervisor import supervise
            announce(f"tokenyard: redis at {dep.redis_url}{' (embedded)' if embedded else ''}")
            return supervise(dep, announce, dev_key)
        app = create_app(dep, dev_key=dev_key)
        gw = app.state.gateway
        config = uvicorn_config(app, dep.connections, host=dep.host, port=dep.port, lifespan="on")
        server = DrainingServer(config, gw, dep.drain_grace_s)
        announce(f"tokenyard: serving {', '.join(dep.engines)} at http://{dep.host}:{dep.port}/v1")
        announce(f"tokenyard: redis at {dep.redis_url}{' (embedded)' if embedded else ''}")
        server.run()
        return 0 if server.started else 1
    finally:
        if embedded is not None:
            embedded.stop()
        for h in logging.getLogger("tokenyard.access").handlers:
            h.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
