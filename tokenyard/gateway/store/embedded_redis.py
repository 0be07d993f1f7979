"""A private redis-server for the embedded default (no REDIS_URL): started at launch, stopped at exit.

It listens on a unix socket only (no TCP port, so nothing else on the machine can reach it by
accident) in `redis_dir`, keeps its data there with the append-only file on, so spend records
and keys survive restarts. If a server from an earlier run still answers on that socket (the
gateway was killed hard), it is reused rather than started twice over the same files.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import redis

log = logging.getLogger(__name__)
REDIS_SERVER = "/usr/bin/redis-server"


class EmbeddedRedisError(RuntimeError):
    pass


class EmbeddedRedis:
    def __init__(self, data_dir: str | Path, binary: str | None = None) -> None:
        self.dir = Path(data_dir).resolve()
        self.socket = self.dir / "redis.sock"
        self.binary = binary or (REDIS_SERVER if Path(REDIS_SERVER).exists() else shutil.which("redis-server"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout_s: float = 10.0) -> str:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._answers():
            log.info("reusing the embedded redis already running on %s", self.socket)
            return self.url
        if not self.binary:
            raise EmbeddedRedisError("no REDIS_URL is set and redis-server is not installed; install redis-server "
                                     "or set REDIS_URL (for example redis://127.0.0.1:6379)")
        if len(str(self.socket)) > 100:  # unix socket paths are limited to ~107 bytes
            raise EmbeddedRedisError(f"{self.socket}: path too long for a unix socket; set redis_dir shorter")
        args = [self.binary, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                "--dir", str(self.dir), "--appendonly", "yes", "--save", "", "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log")]
        # Own session: a Ctrl-C in the terminal reaches the gateway, which then stops Redis last.
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmbeddedRedisError(f"redis-server exited with {self.proc.returncode}; see {self.dir / 'redis.log'}")
            if self._answers():
                return self.url
            time.sleep(0.02)
        self.stop()
        raise EmbeddedRedisError(f"redis-server did not answer on {self.socket} within {timeout_s} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM makes redis fsync its append-only file and exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False


@contextmanager
def command_redis_url(override: str | None, deployment_url: str | None, redis_dir: Path) -> Iterator[str]:
    """The Redis a command-line tool talks to, found as the gateway finds it: --redis-url, else
    REDIS_URL, else the deployment's `redis_url`, else the embedded redis-server under
    `redis_dir` (the gateway's own when it is running; otherwise started for the command and
    stopped after it)."""
    url = override or os.environ.get("REDIS_URL") or deployment_url
    embedded = None
    if not url:
        embedded = EmbeddedRedis(redis_dir)
        url = embedded.start()
    try:
        yield url
    finally:
        if embedded is not None:
            embedded.stop()
