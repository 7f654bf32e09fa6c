"""The Host check of a server without an API key: requests must name an address it listens on.

A web page can reach a server on 127.0.0.1 through DNS rebinding: its own name, resolved again
to 127.0.0.1, makes the browser send the page's requests there as to the page's own origin, with
`Host: <the page's name>`. Refusing Hosts that name none of the server's addresses (as
starlette's TrustedHostMiddleware does) stops that; an API key stops it too, and with one the
check is left out, so that a server behind a proxy or a load balancer is reached by any name.
A Host that is an IP address is no name to resolve again, so it is answered: a page's own
requests carry one only where the page came from that address (another machine reaching a
server on 0.0.0.0 by its address, a container by the host's).
"""

from __future__ import annotations

import ipaddress
import re
import socket

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from runner.deploy.protocol import ApiError
from runner.errors import UserError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
# An Origin header as a browser sends it: scheme://host[:port], in lower case, nothing after.
_ORIGIN = re.compile(r"https?://[a-z0-9.\-\[\]:]+")


def check_origins(origins: list[str]) -> None:
    """allowed_origins as a browser writes an Origin, which is compared byte for byte: one
    written otherwise (a trailing slash, no scheme, capitals) never matched, unsaid."""
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise UserError(
                "allowed_origins",
                origins,
                f"{origin!r} is no origin a browser sends: give scheme://host[:port] in lower "
                "case, with no path or trailing slash (https://chat.example.com), or *",
            )


def check_hosts(hosts: list[str]) -> None:
    """allowed_hosts as a request's Host is compared (its name, without the port): an empty name
    or one with a port never matched a request, unsaid."""
    for name in hosts:
        bare = _normalized(name)
        if not bare or (":" in bare and not _is_address(bare)):
            raise UserError(
                "allowed_hosts",
                hosts,
                f"{name!r} is no host name a request gives: give the name alone, without a "
                "port (chat.example.com, 10.0.0.5), or *",
            )


def allowed_hosts(host: str, extra: list[str]) -> list[str]:
    """The names a request's Host may give: loopback, the bound `host` (for a wildcard address,
    this machine's name), and the `allowed_hosts` the user added."""
    names = [*LOOPBACK_NAMES, host]
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        wildcard = False
    if wildcard:  # 0.0.0.0 or ::, any interface: the machine by its own name
        names += [socket.gethostname(), socket.getfqdn()]
    return list(dict.fromkeys(_normalized(name) for name in [*names, *extra]))


def host_of(header: str) -> str:
    """The host part of a Host header (no port; an IPv6 address without its brackets)."""
    header = header.strip()
    if header.startswith("["):
        return _normalized(header[1:].partition("]")[0])
    return _normalized(header.rpartition(":")[0] if header.count(":") == 1 else header)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _normalized(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


class HostCheckMiddleware:
    """Answers 400, naming the fix, to a request whose Host is none of `allowed` (`*`: any)
    and no IP address; /health answers any Host."""

    def __init__(self, app: ASGIApp, allowed: list[str]) -> None:
        self.app = app
        self._allowed = set(allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" or "*" in self._allowed:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        host = host_of(headers.get(b"host", b"").decode("latin-1"))
        health = scope["type"] == "http" and scope["path"] == "/health"
        if host in self._allowed or _is_address(host) or health:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return  # a websocket closes without being accepted
        named = f"Host {host[:100]!r}" if host else "no Host header"
        names = ", ".join(sorted(self._allowed))
        error = ApiError(
            400,
            f"this server answers requests for {names} or an IP address, and this one gives "
            f"{named} (a web page reaching it through DNS rebinding looks like this): "
            "if you trust that name, start the server with allowed_hosts=[<name>], or require an "
            "API key (api_key.env or api_key.file)",
            code="invalid_host",
        )
        await JSONResponse(error.body(), 400)(scope, receive, send)
