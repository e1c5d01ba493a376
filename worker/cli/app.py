"""The ``rlfleet`` Typer root, its entry point, and the helpers every command uses: the data dir and
config, dispatching an event to the worker, printing a result, and errors on one line.

Heavy imports (torch, the worker) happen inside the commands that need them, so ``rlfleet good`` and
``rlfleet status`` start in well under a second.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from rlfleet.shared.config import Config, data_dir, load_config
from rlfleet.shared.errors import BadInput, RlfleetError
from rlfleet.shared.home import check_home, open_home
from rlfleet.shared.lifecycle import interrupt_on_stop_signals
from rlfleet.shared.queue import EVENTS_QUEUE, QueueHandle, enqueue_event, wait_for

try:  # typer >= 0.2x carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # older typer runs on click itself
    # mypy reads this as a second class under the same name: it sees the installed typer, with its copy
    from click.exceptions import ClickException  # type: ignore[assignment, unused-ignore]

app = typer.Typer(
    name="rlfleet",
    help="Self-improving RL for your local model: rate answers, a LoRA adapter trains in the background.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
ScopeOpt = Annotated[str | None, typer.Option(
    "--scope", help="One scope's own adapter and ratings (`person:slack:U024BE7LH`, `channel:discord:1180…`; "
                    "docs/scopes.md); default: the shared one.")]


def scope_arg(scope: str | None) -> str | None:
    """``--scope`` checked: a scope key, or a clear error."""
    from typing import get_args

    from rlfleet.shared import scopes
    from rlfleet.shared.events import Source

    if scope is None:
        return None
    try:
        return scopes.parse_key(scope, get_args(Source))
    except ValueError as exc:
        raise BadInput(f"--scope: {exc}") from None


def known_scope(cfg: Config, scope: str | None) -> str | None:
    """``--scope`` checked, and held by this data dir (its ratings, runs, a pause or adapter versions):
    a scope misspelt is refused with the ones here, not answered as an empty one (or acted on)."""
    from rlfleet.shared import scopes
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.store import Store

    key = scope_arg(scope)
    if key is None or key == scopes.SHARED:
        return key
    slug = model_slug(cfg.model)
    name = scopes.lineage(slug, key)
    store = Store(cfg.db_url)
    try:
        held = store.scope_lineages(slug)
        if name in held or store.training_paused(name) or AdapterRegistry(cfg.adapters_root, name).versions():
            return key
    finally:
        store.close()
    here = ", ".join(scopes.split(n)[1] for n in held[:10]) + (" …" if len(held) > 10 else "")
    raise BadInput(f"--scope: no scope {key} in this data dir " + (
        f"(scopes here: {here})" if held else
        "(none yet: a person's or a channel's adapter starts with their first rating)"))


@app.callback()
def _root(
    home: Annotated[
        str | None, typer.Option("--home", help="Data dir (default: $RLFLEET_HOME or ~/.rlfleet).")
    ] = None,
) -> None:
    if home is not None:
        # A str, not a Path: Path("") is ".", and an empty --home would quietly use the current folder.
        if not home.strip():
            raise BadInput("--home is empty: give the data dir's path, or leave --home out for ~/.rlfleet")
        os.environ["RLFLEET_HOME"] = str(Path(home).expanduser().resolve())
    check_home(data_dir())


def rewrap_help(root: typer.Typer) -> None:
    """The help of each command of ``root`` (and of its groups) as paragraphs the terminal wraps: typer's
    rich mode keeps a docstring's line breaks in the command list and in a command's later paragraphs,
    which broke lines off mid-sentence. The list shows the first paragraph as one line of text; a
    paragraph that starts with click's ``\\b`` keeps its lines."""
    for info in root.registered_commands:
        text = info.help or (info.callback.__doc__ if info.callback is not None else None)
        if not text:
            continue
        paragraphs = [p if p.startswith("\b") else " ".join(p.split())
                      for p in inspect.cleandoc(text).split("\n\n")]
        info.help = "\n\n".join(paragraphs)
        if info.short_help is None:
            info.short_help = paragraphs[0]
    for group in root.registered_groups:
        if group.typer_instance is not None:
            rewrap_help(group.typer_instance)


def command_config(read_only: bool = False, must_exist: bool = False, **overrides: Any) -> Config:
    """The config, on a data dir made now if missing; ``read_only`` commands (that only show what is there)
    and ``must_exist`` ones (that change or delete what is there: undo, rollback, forget…) refuse a missing
    one instead, so a misspelt --home is an error, not a new empty data dir."""
    # Flags travel as env vars so the workers this process starts (or runs inline) see the same values.
    if overrides.get("threshold") is not None:
        os.environ["RLFLEET_THRESHOLD"] = str(overrides["threshold"])
    if overrides.get("model"):
        os.environ["RLFLEET_MODEL"] = str(overrides["model"])
    if overrides.get("preset"):
        os.environ["RLFLEET_PRESET"] = str(overrides["preset"])
    path = data_dir()
    if open_home(path, read_only or must_exist):
        err.print(f"new data dir created at {escape(str(path))}")
    return load_config()


def _events_worker_alive(handle: QueueHandle) -> bool:
    from rlfleet.shared.workers import serving

    return serving(handle.redis, EVENTS_QUEUE)


def work_if_nobody_does(handle: QueueHandle, cfg: Config) -> None:
    if not _events_worker_alive(handle):
        from rlfleet.worker.runner import run_worker

        run_worker(cfg, "events", burst=True, handle=handle)


def dispatch(handle: QueueHandle, cfg: Config, event: Any, timeout: float = 15.0) -> dict:
    """Enqueue an event and return what the worker made of it.

    With no events worker alive (nothing running), the queue is worked right here, so commands
    work on their own; the event is in Redis (append-only) before anything else happens.
    """
    ticket = enqueue_event(handle, event)
    work_if_nobody_does(handle, cfg)
    result = wait_for(ticket, timeout)
    if result is None:
        return {"ok": True, "message": "queued; a worker will apply it shortly", "queued": True}
    return result


def emit(result: dict, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(result, default=str))
    elif result.get("ok"):
        out.print(escape(str(result.get("message", "ok"))))
        if result.get("training"):
            out.print(f"[cyan]{escape(str(result['training']))}[/]")
    if not result.get("ok"):
        if not as_json:
            err.print(f"[red]error:[/] {one_line(str(result.get('message', 'failed')))}")
        raise typer.Exit(2)


ERROR_CHARS = 500


def one_line(text: str, limit: int = ERROR_CHARS) -> str:
    """An error message as one printable line. Messages echo what the user typed: a newline or a control
    character in it would break the one-line error, a 100 kB argument would bury it, and rich markup in
    it (``[/x]``) made rich raise MarkupError, a traceback instead of the error."""
    flat = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    if len(flat) > limit:
        flat = flat[:limit] + "…"
    return escape(flat)


def _usage_line(exc: ClickException) -> str:
    ctx = getattr(exc, "ctx", None)
    hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    return one_line(exc.format_message()) + escape(hint)


def main(argv: list[str] | None = None) -> None:
    """The ``rlfleet`` entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    interrupt_on_stop_signals()
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        for n, arg in enumerate(args, 1):
            # Bytes that are not UTF-8 arrive as lone surrogates; pydantic refused some fields and crashed
            # serialising others (rollback's version): refuse them here, before anything runs.
            if not arg.isascii():
                try:
                    arg.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadInput(f"argument {n} is not valid UTF-8 text") from None
        # standalone_mode=False: click's usage errors come to us and print as one line (click's own
        # format is a usage block and a boxed panel), like every other error.
        code = app(args=args, prog_name="rlfleet", standalone_mode=False)
    except ClickException as exc:
        if type(exc).__name__ != "NoArgsIsHelpError":  # that one printed the help already (typer's own test)
            err.print(f"[red]error:[/] {_usage_line(exc)}")
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(1)
    except RlfleetError as exc:
        err.print(f"[red]error:[/] {one_line(str(exc))}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
    if isinstance(code, int) and code:
        sys.exit(code)
