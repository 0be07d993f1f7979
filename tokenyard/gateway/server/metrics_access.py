"""Who may read GET /metrics (`metrics.access` in the deployment file).

    loopback (default)  clients connecting from 127.0.0.0/8 or ::1 that also address the server by a
                        loopback name (Host: localhost, 127.0.0.1, [::1], any port) read it without a
                        key (a Prometheus on the same host, or `curl` on the box); anyone else needs
                        an admin key
    admin               an admin key always (Authorization: Bearer ...), loopback included
    open                anyone who can reach the port

Why loopback by default: the metrics carry no tenant names or prompt text, but they do reveal load,
engines, error rates and shedding, which is operational information an outside caller should not
get for free, while a local scraper should not need a secret in its config. Behind a reverse proxy
on the same host every client looks like loopback: use `admin` there.
"""
from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from starlette.requests import Request

from tokenyard.gateway.edge.errors import Forbidden

if TYPE_CHECKING:
    from tokenyard.gateway.state import Gateway


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _names_loopback(host_header: str | None) -> bool:
    """The Host header names this machine's loopback (localhost, 127.x.y.z, [::1], any port).
    Without this check a web page on evil.example whose name is re-pointed at 127.0.0.1 (DNS
    rebinding) makes the visitor's browser a loopback client that reads the answer."""
    if not host_header:
        return False
    host = host_header.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, colon, port = host.partition(":")
        if colon and not (port.isascii() and port.isdigit()):
            return False
    return name == "localhost" or name.endswith(".localhost") or _is_loopback(name)


async def check_metrics_access(gw: "Gateway", request: Request) -> None:
    """Returns when allowed; raises 401 (no or bad key) or 403 (not an admin key) otherwise."""
    mode = gw.deployment.web.metrics.access
    if mode == "open":
        return
    if mode == "loopback" and _is_loopback(request.client.host if request.client else None) \
            and _names_loopback(request.headers.get("host")):
        return
    key = await gw.keys.authenticate(request.headers.get("authorization"))
    if not key.is_admin:
        raise Forbidden("Only admin keys may read /metrics from outside this host", code="admin_required")
