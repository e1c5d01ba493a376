"""An aiohttp app listening on an address for as long as a block runs: what `rlfleet serve`, the
Slack and Telegram HTTP modes, the Teams endpoint and the web app share (and the tests, on port 0)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from .errors import BadInput, ConfigError


@asynccontextmanager
async def listening(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` inside the block; yields the port (the real one when 0 was asked)."""
    _check_port(port)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(_cannot_listen(host, port, exc)) from None
        addresses = runner.addresses  # (host, port) of each bound socket
        yield addresses[0][1] if addresses else port
    finally:
        await runner.cleanup()


async def until_cancelled() -> None:
    await asyncio.Event().wait()


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only localhost is known to stay on this machine
        return False


def check_bindable(host: str, port: int) -> None:
    """Refuse now, on one line, an address this process cannot listen on (taken, not this machine's, a
    port that needs root): a server that loads a model first would otherwise fail after it, with a
    trace. The socket is closed at once; the server binds its own."""
    _check_port(port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"cannot listen on {host!r}: {getattr(exc, 'strerror', None) or exc}; "
                          "give an address of this machine (127.0.0.1, 0.0.0.0)") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds
        try:
            sock.bind(address)
        except OSError as exc:
            raise ConfigError(_cannot_listen(host, port, exc)) from None


def _check_port(port: int) -> None:
    if not 0 <= port <= 65535:
        raise BadInput(f"{port} is not a port: give one from 1 to 65535 (0: any free one)")


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use: stop what listens there, or pick another --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine: listen on 127.0.0.1, 0.0.0.0 or one of its own"
    if exc.errno == errno.EACCES:
        return f"port {port} needs more privileges than this user has: pick one above 1023"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}"
