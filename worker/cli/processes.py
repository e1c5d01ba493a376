"""The commands that run in the foreground: ``rlfleet worker``, ``bot``, ``serve``, ``bridge``, ``chat``, and
``up``, which runs them all under its supervision with a live status panel."""

from __future__ import annotations

import logging
import time
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from rlfleet.shared.config import Config
from rlfleet.shared.errors import BadInput
from rlfleet.shared.queue import queue_for
from rlfleet.shared.status import status_dict
from rlfleet.shared.status_view import render_status
from rlfleet.shared.webserver import check_bindable

from .app import app, command_config, dispatch, err, out
from .fleet import BackgroundWorkers
from .setup import write_secret


def _log_to_stderr() -> None:
    """What a foreground service logs: our own news, and everyone's warnings."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlfleet").setLevel(logging.INFO)


@app.command()
def worker(
    queue: Annotated[str, typer.Option("--queue", help="events | train | all")] = "all",
    burst: Annotated[bool, typer.Option(help="Quit when the queues are empty.")] = False,
) -> None:
    """Run one worker in the foreground (for scale-out: many events workers, one trainer per model)."""
    if queue not in ("events", "train", "all"):
        raise BadInput(f"unknown queue {queue!r}: use events, train or all")
    from rlfleet.shared.allocator import preload
    from rlfleet.worker.runner import run_worker

    cfg = command_config()
    if queue in ("train", "all"):
        preload(cfg.train.allocator)  # (an exec: the command starts again with it preloaded)
    run_worker(cfg, queue, burst=burst)


@app.command()
def bot(
    platform: Annotated[str, typer.Argument(help="slack | discord | telegram | teams")],
    http: Annotated[bool | None, typer.Option(
        "--http/--no-http", help="Serve an HTTP endpoint (Slack events, Telegram webhook) instead of a socket / "
        "long polling. Teams always serves HTTP.")] = None,
    host: Annotated[str | None, typer.Option(help="Address of the HTTP endpoint (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port of the HTTP endpoint.")] = None,
) -> None:
    """Run one platform's bot in the foreground: it answers people with the responder (`rlfleet serve`
    or any OpenAI-compatible server) and turns /rl commands, reactions and buttons into ratings.
    Tokens come from the env vars named in config.toml (section bots.PLATFORM) or 0600 files."""

    from rlfleet.bots.runner import run_bot

    _log_to_stderr()
    run_bot(platform, command_config(), http=http, host=host, port=port)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on. Anything but loopback exposes the model.")] = "",
    port: Annotated[int | None, typer.Option(help="Port (default: the one in responder.url, else 8000).")] = None,
) -> None:
    """Serve the local model (base + current adapter) as an OpenAI-compatible chat-completions API: what
    the bots answer with. A promotion or rollback is live on the next request."""
    import asyncio
    from urllib.parse import urlparse

    from rlfleet.shared.responder import responder_for
    from rlfleet.shared.serve import serve as serve_forever

    _log_to_stderr()
    cfg = command_config()
    url_port = urlparse(cfg.responder.url).port
    host = host or "127.0.0.1"
    port = port if port is not None else (url_port if _serves_locally(cfg) and url_port else 8000)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/] listening on {host}: anyone who can reach it can use the model")
    check_bindable(host, port)  # before the seconds of loading the model
    with err.status(f"loading {cfg.model}…"):
        responder = responder_for(cfg)
    out.print(f"serving {cfg.model} ({responder.active_version or 'base'}) on http://{host}:{port}/v1, tokens drawn "
              f"by {responder.engine}")
    asyncio.run(serve_forever(responder, cfg.model, host, port))


@app.command()
def bridge(
    host: Annotated[str | None, typer.Option(help="Address (default 127.0.0.1; anything else is exposed).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8765).")] = None,
) -> None:
    """The signed local HTTP API for agents, hooks and gateways (OpenAPI at /openapi.json)."""
    import asyncio

    from rlfleet.bridge.app import load_keys, make_app
    from rlfleet.shared.webserver import listening, until_cancelled

    _log_to_stderr()
    cfg = command_config()
    host = host or cfg.bridge.host
    port = cfg.bridge.port if port is None else port
    keys = load_keys(cfg)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/] the bridge listens on {host}: reachable from other machines")

    async def serve_bridge() -> None:
        with queue_for(cfg) as q:
            async with listening(make_app(cfg, q, keys), host, port) as bound:
                out.print(f"bridge on http://{host}:{bound} (OpenAPI: /openapi.json)")
                await until_cancelled()

    asyncio.run(serve_bridge())


def _serves_locally(cfg: Config) -> bool:
    """Whether the bots' responder is `rlfleet serve` on this machine (so `up` starts it)."""
    from urllib.parse import urlparse

    return urlparse(cfg.responder.url).hostname in ("127.0.0.1", "localhost", "::1")


def not_started(cfg: Config, bots: tuple[str, ...], serve: bool) -> dict[str, str]:
    """What `up` could run but does not, and how to make it."""
    skipped = {}
    if not bots:
        skipped["bots"] = "none enabled: `rlfleet init --bot slack` (or discord, telegram, teams)"
    if not serve:
        skipped["serve"] = ("only for the bots, and none is enabled" if not bots else
                            f"the bots answer with {cfg.responder.url}, not this machine (responder.url)")
    return skipped


def children_panel(workers: BackgroundWorkers, skipped: dict[str, str]) -> Table:
    """Every child `up` runs with its state and log, then what it does not run and why."""
    t = Table(show_header=False, box=None, pad_edge=False)
    for name, line in workers.lines().items():
        colour = "green" if line == "running" else "yellow" if line.startswith("restarted") else "red"
        t.add_row(name, f"[{colour}]{escape(line)}[/] [dim](log: {escape(str(workers.log_path(name)))})[/]")
    for name, why in skipped.items():
        t.add_row(name, f"[dim]not started: {escape(why)}[/]")
    return t


@app.command()
def up(
    threshold: Annotated[int | None, typer.Option(help="Ratings that start a training run.")] = None,
) -> None:
    """Start Redis (embedded when no REDIS_URL) and the workers, with a live status panel. Ctrl-C stops.

    A worker, bot, responder or bridge that dies is started again (at once after a long life, with
    growing waits after quick exits, not after six quick exits in a row)."""
    from rich.live import Live

    from rlfleet.bots.runner import enabled_bots

    cfg = command_config(threshold=threshold)
    if write_secret(cfg.secret_path):  # a data dir made by `chat` has none yet, and the bridge needs it
        err.print(f"made secret file {escape(str(cfg.secret_path))} (mode 0600) for the bridge")
    from rlfleet.bots.web.login import ensure_token
    from rlfleet.bots.web.run import announce

    bots = tuple(enabled_bots(cfg))
    serve = bool(bots) and _serves_locally(cfg)
    with queue_for(cfg) as q:
        workers = BackgroundWorkers(cfg, bots=bots, serve=serve, bridge=True, web=True)
        announce(cfg, cfg.web.host, cfg.web.port, made=ensure_token(cfg.web_token_path)[1])
        workers.start()
        try:
            with Live(console=out, refresh_per_second=2, transient=False) as live:
                while True:
                    grid = Table.grid()
                    grid.add_row(render_status(status_dict(cfg, q)))
                    grid.add_row(children_panel(workers, not_started(cfg, bots, serve)))
                    grid.add_row("[dim]Ctrl-C to stop[/]")
                    live.update(grid)
                    time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        finally:
            err.print("stopping workers…")
            workers.stop()


@app.command()
def web(
    host: Annotated[str | None, typer.Option(help="Address to listen on (default web.host: 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default web.port: 8790).")] = None,
    no_worker: Annotated[bool, typer.Option("--no-worker", help="Do not start background workers.")] = False,
) -> None:
    """Chat and rate in a browser: a local web app for the data dir's owner, behind a login token.

    The token is made on first start (0600, in the data dir as web-token) and printed here when this is
    a terminal (to a pipe or a log, only its file is named). It listens on 127.0.0.1 unless told
    otherwise; elsewhere, put TLS in front."""
    from rlfleet.bots.web.run import run_web

    cfg = command_config()
    host, port = host or cfg.web.host, cfg.web.port if port is None else port
    check_bindable(host, port)  # before the model loads
    workers = None if no_worker else BackgroundWorkers(cfg)
    with queue_for(cfg) as q:
        if workers:
            workers.start()
        try:
            run_web(cfg, q, dispatch, host, port)
        finally:
            if workers:
                err.print("stopping workers…")
                workers.stop()


@app.command()
def chat(
    model: Annotated[str | None, typer.Option(help="Base model (overrides config).")] = None,
    threshold: Annotated[int | None, typer.Option(help="Ratings that start a training run.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Longest answer, in tokens.")] = None,
    no_worker: Annotated[bool, typer.Option("--no-worker", help="Do not start background workers.")] = False,
) -> None:
    """Chat with the local model in the terminal and rate each answer; training runs in the background."""
    from rlfleet.bots.terminal import run_chat

    cfg = command_config(model=model, threshold=threshold)
    if max_new_tokens:
        cfg.chat.max_new_tokens = max_new_tokens
    run_chat(cfg, dispatch, workers=None if no_worker else BackgroundWorkers(cfg))
