"""Run the web app: the login token, the answering model, the HTTP server on the configured address."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rich.console import Console
from rich.markup import escape

from rlfleet.shared.config import Config
from rlfleet.shared.queue import QueueHandle
from rlfleet.shared.webserver import is_loopback, listening, until_cancelled

from .app import Dispatch, WebApp, build_app
from .login import ensure_token

log = logging.getLogger(__name__)
console = Console(highlight=False, stderr=True)


def local_responder(cfg: Config) -> Any:
    """The model answering in the browser: the base plus the current adapter, hot-swapped per answer."""
    from rlfleet.shared.responder import responder_for

    return responder_for(cfg)


def announce(cfg: Config, host: str, port: int, made: bool) -> None:
    """Tell the owner where to log in and with what: the token itself only to a terminal, so that it
    never lands in a log file (`rlfleet up` runs this as a child whose output is logged)."""
    token, _ = ensure_token(cfg.web_token_path)
    console.print(f"[bold]rlfleet web[/] on http://{escape(host)}:{port}/")
    shown = f"[bold]{escape(token)}[/] " if console.is_terminal else ""
    console.print(f"login token: {shown}({'made now, ' if made else ''}"
                  f"kept in {escape(str(cfg.web_token_path))}, mode 0600)")
    if not is_loopback(host):
        console.print(f"[yellow]warning: listening on {escape(host)}, beyond this machine: put TLS in front "
                      "(a reverse proxy with https), or the login token and cookie travel in the clear[/]")


async def serve(cfg: Config, handle: QueueHandle, responder: Any, dispatch: Dispatch, host: str, port: int) -> None:
    token, made = ensure_token(cfg.web_token_path)
    app = build_app(WebApp(cfg, handle, responder, dispatch, token, token_path=cfg.web_token_path))
    async with listening(app, host, port) as bound:
        announce(cfg, host, bound, made)
        await until_cancelled()


def run_web(cfg: Config, handle: QueueHandle, dispatch: Dispatch, host: str | None = None,
            port: int | None = None) -> None:
    """Load the model and serve until Ctrl-C."""
    with console.status(f"loading {cfg.model}…"):
        responder = local_responder(cfg)
    try:
        asyncio.run(serve(cfg, handle, responder, dispatch, host or cfg.web.host,
                          cfg.web.port if port is None else port))
    except KeyboardInterrupt:
        pass
