"""An aiohttp app listening on an address for as long as a block runs: what `rlfleet serve`, the
Slack and Telegram HTTP modes, the Teams endpoint and the web app share (and the tests, on port 0)."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def listening(app: web.Application, host: str, port: int) -> AsyncIterator[int]:
    """Serve ``app`` on ``host:port`` inside the block; yields the port (the real one when 0 was asked)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
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
