"""``rlfleet``: the terminal front end. One verb per command, ``--json`` where it prints data,
errors on one line with the fix. Everything that changes state goes through the queue as an event.

Heavy imports (torch, the worker) happen inside the commands that need them, so ``rlfleet good`` and
``rlfleet status`` start in well under a second.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from .config import Config, data_dir, load_config
from .errors import BadInput, RlfleetError
from .events import PLATFORMS, Capture, Command, Message, Rating, Undo, describe_validation_error
from .queue import EVENTS_QUEUE, QueueHandle, enqueue_event, open_queue, wait_for

try:  # typer >= 0.2x carries its own copy of click
    from typer._click.exceptions import ClickException
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException

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


# ---- plumbing ---------------------------------------------------------------------------------------


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


def check_home(path: Path) -> None:
    """Refuse a data dir path that can never be one (a file, or a file on the way to it)."""
    try:
        if path.exists() and not path.is_dir():
            raise BadInput(f"data dir {path} is a file, not a folder: pick another --home")
        ancestor = next(p for p in path.parents if p.exists())
    except OSError as exc:  # a name too long for the file system, say
        raise BadInput(f"cannot use {path} as the data dir: {exc.strerror}") from None
    if not ancestor.is_dir():
        raise BadInput(f"cannot make data dir {path}: {ancestor} is a file, not a folder")


def open_home(path: Path, read_only: bool) -> None:
    """The data dir for a command. Commands that write make a missing one and say so (a misspelt
    --home would otherwise quietly start an empty one); commands that only read refuse it instead of
    leaving an empty data dir behind."""
    if path.is_dir():
        return
    if read_only:
        raise BadInput(f"no data dir at {path}: `rlfleet chat` or `rlfleet init` makes one "
                       "(or check --home / $RLFLEET_HOME for a typo)")
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise BadInput(f"cannot make data dir {path}: {exc.strerror}") from None
    err.print(f"new data dir created at {escape(str(path))}")


def _config(read_only: bool = False, **overrides: Any) -> Config:
    # Flags travel as env vars so the workers this process starts (or runs inline) see the same values.
    if overrides.get("threshold") is not None:
        os.environ["RLFLEET_THRESHOLD"] = str(overrides["threshold"])
    if overrides.get("model"):
        os.environ["RLFLEET_MODEL"] = str(overrides["model"])
    if overrides.get("preset"):
        os.environ["RLFLEET_PRESET"] = str(overrides["preset"])
    open_home(data_dir(), read_only)
    return load_config()


def _events_worker_alive(handle: QueueHandle) -> bool:
    from .workers import serving

    return serving(handle.redis, EVENTS_QUEUE)


def _work_if_nobody_does(handle: QueueHandle, cfg: Config) -> None:
    if not _events_worker_alive(handle):
        from rlfleet.worker.runner import run_worker

        run_worker(cfg, "events", burst=True, handle=handle)


def dispatch(handle: QueueHandle, cfg: Config, event: Any, timeout: float = 15.0) -> dict:
    """Enqueue an event and return what the worker made of it.

    With no events worker alive (nothing running), the queue is worked right here, so commands
    work on their own; the event is in Redis (append-only) before anything else happens.
    """
    ticket = enqueue_event(handle, event)
    _work_if_nobody_does(handle, cfg)
    result = wait_for(ticket, timeout)
    if result is None:
        return {"ok": True, "message": "queued; a worker will apply it shortly", "queued": True}
    return result


@contextmanager
def _queue(cfg: Config):
    handle = open_queue(cfg)
    try:
        yield handle
    finally:
        handle.close()


def _emit(result: dict, as_json: bool) -> None:
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


def _stop_on_signal(signum: int, _frame: object) -> None:
    # A `kill` or a closed terminal must unwind like Ctrl-C: workers stopped, the embedded Redis
    # released (an orphaned server would outlive us). RQ's own worker installs its own handlers.
    raise KeyboardInterrupt


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
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
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


# ---- init -------------------------------------------------------------------------------------------


def write_secret(path: Path) -> bool:
    """Create the 0600 secret file once; never print or log it. Returns True if it was made now."""
    if path.exists():
        os.chmod(path, 0o600)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32) + "\n")
    return True


@app.command()
def init(
    model: Annotated[str | None, typer.Option(help="Base model: 'smollm2-135m', a local folder, or a hub id.")] = None,
    preset: Annotated[str | None, typer.Option(help="careful | balanced | aggressive")] = None,
    threshold: Annotated[int | None, typer.Option(help="Ratings that start a training run.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="No questions: take flags and defaults.")] = False,
    check_model: Annotated[bool, typer.Option(help="Load the model once to check it works.")] = True,
    bot: Annotated[list[str] | None, typer.Option(
        help="Enable a chat platform's bot: slack, discord, telegram or teams (repeatable).")] = None,
    admin: Annotated[list[str] | None, typer.Option(
        help="PLATFORM:USER_ID allowed /rl train, rollback, reset (repeatable).")] = None,
    rater: Annotated[list[str] | None, typer.Option(
        help="PLATFORM:USER_ID allowed to rate answers given to others (repeatable).")] = None,
    agent: Annotated[list[str] | None, typer.Option(
        help="Install hooks in a coding agent: claude-code or codex (repeatable). Its answers are captured, "
             "and /rl good typed in it rates them.")] = None,
) -> None:
    """Write config.toml and the secret file in the data dir, and check the model loads."""
    cfg = _config()
    if agent:
        from rlfleet.bridge.agents import agent as known_agent

        for name in agent:  # before anything is written: an unknown agent used to fail after config.toml was saved
            known_agent(name)
    interactive = _stdin_is_tty() and not yes
    if interactive:
        model = model or typer.prompt("Base model (smollm2-135m, a local folder, or org/name)", default=cfg.model)
        preset = preset or typer.prompt("Preset (careful / balanced / aggressive)", default=cfg.train.preset)
        threshold = threshold or typer.prompt("Ratings per training run", default=cfg.train.threshold, type=int)
    data = cfg.model_dump(exclude={"home"})
    _init_bots(data, interactive, bot or [], admin or [], rater or [])
    if model:
        data["model"] = model
    if preset:
        data["train"]["preset"] = preset
    if threshold is not None:
        data["train"]["threshold"] = threshold
    try:
        new = Config(home=cfg.home, **data)
    except ValidationError as exc:
        raise BadInput(describe_validation_error(exc, "bad value")) from None
    from .models import resolve_model

    ref = resolve_model(new.model)
    if check_model:
        with err.status(f"loading {new.model} to check it works…"):
            from .models import load_model, load_tokenizer

            load_tokenizer(ref)
            load_model(ref)
    path = new.save()
    made = write_secret(new.secret_path)
    out.print(f"wrote {path}")
    out.print(f"{'made' if made else 'kept'} secret file {new.secret_path} (mode 0600)")
    out.print(f"model {new.model} · preset {new.train.preset} · training every {new.train.threshold} ratings")
    for name in PLATFORMS:
        b = new.bots.get(name)
        if b is not None and b.enabled:
            have = "set" if os.environ.get(b.token_env) or b.token_file else "[yellow]not set yet[/]"
            out.print(f"bot {name}: token from ${b.token_env} ({have}) · {len(b.admins)} admins · "
                      f"{len(b.raters)} raters")
    for name in agent or []:
        _install_agent(name, new)
    out.print("next: [bold]rlfleet chat[/]  or  [bold]rlfleet up[/]")


def _install_agent(name: str, cfg: Config) -> None:
    from rlfleet.bridge.agents import install

    custom_home = cfg.home.resolve() != (Path.home() / ".rlfleet").resolve()
    a, changed = install(name, cfg.home, custom_home)
    out.print(f"{name}: hooks {'installed in' if changed else 'already in'} {a.path}"
              + (" (backed up first)" if changed and a.path.exists() else ""))
    if a.note:
        out.print(f"[yellow]{name}:[/] {a.note}")


@app.command()
def uninstall(
    agent: Annotated[list[str], typer.Option(help="claude-code or codex (repeatable).")],
) -> None:
    """Remove exactly rlfleet's hooks from a coding agent's settings (other hooks stay as they are)."""
    from rlfleet.bridge.agents import uninstall as remove

    cfg = load_config()  # the data dir may be gone already: the hooks still come out
    for name in agent:
        a, changed = remove(name, cfg.home)
        out.print(f"{name}: {'removed our hooks from' if changed else 'no rlfleet hooks in'} {a.path}")


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def _split_ids(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _init_bots(data: dict, interactive: bool, bots: list[str], admins: list[str], raters: list[str]) -> None:
    """Apply --bot/--admin/--rater (PLATFORM:ID) to the config dict, and ask for them in the wizard."""
    for name in bots:
        if name not in PLATFORMS:
            raise BadInput(f"unknown platform {name!r} for --bot: use {', '.join(PLATFORMS)}")
        data["bots"][name]["enabled"] = True
    for flag, key, values in (("--admin", "admins", admins), ("--rater", "raters", raters)):
        for item in values:
            platform, _, uid = item.partition(":")
            if platform not in PLATFORMS or not uid.strip():
                raise BadInput(f"{flag} {item!r}: use PLATFORM:USER_ID, e.g. slack:U012AB3CD")
            if uid.strip() not in data["bots"][platform][key]:
                data["bots"][platform][key].append(uid.strip())
    if not interactive:
        return
    enabled = ",".join(p for p in PLATFORMS if data["bots"][p]["enabled"])
    chosen = _split_ids(typer.prompt(
        "Chat platforms to run bots on (comma-separated: slack, discord, telegram, teams; '-' for none)",
        default=enabled or "-"))
    chosen = [] if chosen == ["-"] else chosen
    for name in chosen:
        if name not in PLATFORMS:
            raise BadInput(f"unknown platform {name!r}: use {', '.join(PLATFORMS)}")
    for name in PLATFORMS:
        data["bots"][name]["enabled"] = name in chosen
    for name in chosen:
        section = data["bots"][name]
        section["token_env"] = typer.prompt(f"{name}: env var that holds the token", default=section["token_env"])
        for key, what in (("admins", "user ids allowed /rl train, rollback, reset"),
                          ("raters", "user ids allowed to rate answers given to others")):
            answer = typer.prompt(f"{name}: {what} (comma-separated, '-' for none)",
                                  default=",".join(section[key]) or "-")
            section[key] = [] if answer.strip() == "-" else _split_ids(answer)


# ---- capture and rate -------------------------------------------------------------------------------


def _read_text(value: str) -> str:
    """``@file`` reads a file, ``-`` reads stdin: long answers don't have to fit in an argument."""
    if value == "-":
        data = sys.stdin.buffer.read()
    elif value.startswith("@"):
        try:
            data = Path(value[1:]).read_bytes()
        except OSError as exc:
            raise BadInput(f"cannot read {value[1:]}: {exc.strerror}") from None
    else:
        return value
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadInput("input is not valid UTF-8") from None


@app.command()
def capture(
    prompt: Annotated[str, typer.Option(help="The user's message (or @file, or - for stdin).")],
    response: Annotated[str, typer.Option(help="The answer that was given (or @file, or -).")],
    conversation: Annotated[str, typer.Option(help="Conversation or session id.")] = "default",
    message_ref: Annotated[str | None, typer.Option(help="Your id for this answer, to rate it by later.")] = None,
    source: Annotated[str, typer.Option(help="Where it came from (cli, claude-code, codex, bridge…).")] = "cli",
    model: Annotated[str, typer.Option(help="What produced the answer.")] = "external",
    as_json: JsonOpt = False,
) -> None:
    """Record an answer produced elsewhere so it can be rated; prints the capture id."""
    cfg = _config()
    try:
        ev = Capture(
            source=source, conversation=conversation, message_ref=message_ref,
            prompt=[Message(role="user", content=_read_text(prompt))], response=_read_text(response), model=model,
        )
    except Exception as exc:
        raise BadInput(_validation_line(exc)) from None
    with _queue(cfg) as q:
        result = dispatch(q, cfg, ev)
    if as_json:
        _emit(result, True)
    elif result.get("ok"):
        out.print(result.get("capture_id") or ev.capture_id)
    else:
        _emit(result, False)


def _rate(value: int, target: str, comment: str | None, conversation: str | None, as_json: bool) -> None:
    cfg = _config()
    try:
        ev = Rating(target=target, value=value, comment=comment, conversation=conversation)
    except Exception as exc:
        raise BadInput(_validation_line(exc)) from None
    with _queue(cfg) as q:
        result = dispatch(q, cfg, ev)
    _emit(result, as_json)


TargetOpt = Annotated[str, typer.Option("--target", help="A capture id or message ref, or 'last'.")]
CommentOpt = Annotated[str | None, typer.Option("--comment", help="Why (kept with the rating).")]
ConvOpt = Annotated[str | None, typer.Option("--conversation", help="With --target last: in this conversation.")]


@app.command()
def good(target: TargetOpt = "last", comment: CommentOpt = None, conversation: ConvOpt = None,
         as_json: JsonOpt = False) -> None:
    """Rate an answer good (the last one by default)."""
    _rate(1, target, comment, conversation, as_json)


@app.command()
def bad(target: TargetOpt = "last", comment: CommentOpt = None, conversation: ConvOpt = None,
        as_json: JsonOpt = False) -> None:
    """Rate an answer bad (the last one by default)."""
    _rate(-1, target, comment, conversation, as_json)


@app.command()
def undo(as_json: JsonOpt = False) -> None:
    """Take back your most recent rating."""
    cfg = _config()
    with _queue(cfg) as q:
        _emit(dispatch(q, cfg, Undo()), as_json)


# ---- status -----------------------------------------------------------------------------------------


def status_dict(cfg: Config, handle: QueueHandle | None) -> dict:
    from .models import model_slug
    from .status import build_status
    from .store import Store

    slug = model_slug(cfg.model)
    return build_status(cfg, Store(cfg.db_url), handle.redis if handle else None, slug)


def render_status(st: dict) -> Group:
    t = Table(show_header=False, box=None, pad_edge=False)
    r = st["ratings"]
    t.add_row("model", st["model"])
    t.add_row("ratings", f"{r['total']} ({r['good']} good, {r['bad']} bad), {r['pending']} pending "
              f"of {st['threshold']} to train")
    t.add_row("baseline (EMA)", f"{st['ema']:+.3f}" if st["ema_seeded"] else "not seeded yet")
    t.add_row("adapter", st["adapter"]["current"] or "base model (no adapter)")
    tr = st["training"]
    line = tr["state"]
    if tr.get("progress"):
        p = tr["progress"]
        line += f" · {p['phase']} step {p['step']}/{p['total']} · {p['tokens_per_s']:.0f} tok/s"
    if tr.get("error"):
        line += f" · [red]{escape(tr['error'])}[/]"
    t.add_row("training", line)
    t.add_row("queue", f"{st['queue']['events']} events, {st['queue']['train']} training jobs waiting")
    if st["queue"].get("dead_letters"):
        t.add_row("set aside", f"[red]{st['queue']['dead_letters']} events the worker failed on[/red]: "
                  "`rlfleet events --dead` shows them, `--retry` tries them again")
    t.add_row("workers", str(st["workers"]))
    for name, b in st.get("bots", {}).items():
        t.add_row(f"bot {name}", bot_line(b))
    if (st.get("durability") or {}).get("warning"):
        t.add_row("durability", f"[yellow]{escape(st['durability']['warning'])}[/]")
    for p in st.get("push", []):
        mark = {True: "[green]ok[/]", False: "[red]failed[/]", None: "[yellow]manual[/]"}[p["ok"]]
        t.add_row(f"push {p['target']}", f"{mark} {p['version'] or 'base'} · {escape(p['message'])}")
    versions = st["adapter"]["versions"]
    if not versions:
        return Group(t)
    return Group(t, versions_table(versions[-10:], title="versions (newest last)"))


def bot_line(b: dict) -> str:
    """connected / retrying since when / not running, and the last error with its time."""
    colour = {"connected": "green", "retrying": "yellow"}.get(b["state"], "red")
    line = f"[{colour}]{b['state']}[/]"
    if b.get("since"):
        line += f" since {b['since'][:19].replace('T', ' ')} UTC"
    if b.get("last_error"):
        line += f" · last error {b['last_error_at'][11:19]}: {escape(b['last_error'])}"
    return line


HISTORY_FIELDS = ("ratings_used", "heldout_n", "heldout_margin_before", "heldout_margin_after", "heldout_kl",
                  "final_mean_kl", "accepted_token_frac", "accepted_seq_frac", "verdict", "reason")


def history_rows(versions: list[dict]) -> list[dict]:
    return [
        {"version": v["version"], "status": v["status"], "created": v["created"], "parent": v.get("parent"),
         **{k: v["metrics"].get(k) for k in HISTORY_FIELDS}}
        for v in versions
    ]


def versions_table(versions: list[dict], title: str | None = None) -> Table:
    """One row per version, narrow enough for 80 columns (the rest is in --json and meta.json)."""
    t = Table("version", "status", "created", "ratings", "held-out margin", "KL", "acc tok", "verdict",
              box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    for r in history_rows(versions):
        before, after = r["heldout_margin_before"], r["heldout_margin_after"]
        margin = f"{before:+.3f} → {after:+.3f}" if before is not None and after is not None else "–"
        verdict = r["verdict"] or ""
        if r["reason"] and r["status"] != "active":
            verdict += f": {r['reason']}"
        kl = r["heldout_kl"] if r["heldout_kl"] is not None else r["final_mean_kl"]
        t.add_row(r["version"], r["status"], (r["created"] or "")[5:16].replace("T", " "),
                  str(r["ratings_used"] or ""), margin, _fmt(kl, 3), _fmt(r["accepted_token_frac"], 2),
                  escape(verdict))
    return t


def _fmt(v: Any, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else ""


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Ratings, baseline, adapter versions, training state, queue and workers."""
    cfg = _config(read_only=True)
    with _queue(cfg) as q:
        st = status_dict(cfg, q)
    if as_json:
        out.print_json(json.dumps(st, default=str))
    else:
        out.print(render_status(st))


# ---- training and versions --------------------------------------------------------------------------


@app.command()
def train(
    wait: Annotated[bool, typer.Option("--wait", help="Stay until the run ends (runs it here if no worker).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Start a training run now on the pending ratings (below the threshold too)."""
    cfg = _config()
    with _queue(cfg) as q:
        result = dispatch(q, cfg, Command(name="train"))
        if not (wait and result.get("ok")):
            if result.get("ok") and not as_json and not _train_worker_alive(q):
                result["message"] += "; it runs when `rlfleet up` or `rlfleet chat` is running (or use --wait)"
            _emit(result, as_json)
            return
        _emit(_wait_for_training(cfg, q, as_json), as_json)


def _train_worker_alive(handle: QueueHandle) -> bool:
    from .queue import TRAIN_QUEUE
    from .workers import serving

    return serving(handle.redis, TRAIN_QUEUE)


def _wait_for_training(cfg: Config, q: QueueHandle, quiet: bool) -> dict:
    import threading

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .models import model_slug
    from .status import training_state
    from .store import Store

    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    run = store.latest_run(slug)
    run_id = run.id if run else None
    done = threading.Event()

    def watch() -> None:
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=err,
                      disable=quiet) as bar:
            task = bar.add_task("waiting for the training worker", total=None, rate="")
            while not done.is_set():
                current = store.get_run(run_id) if run_id else None
                if current is None or current.state not in ("queued", "running"):
                    break
                tr = training_state(store, q.redis, slug)
                if tr["state"] == "failed":
                    break
                p = tr.get("progress")
                if p:
                    bar.update(task, description=f"training {p.get('version') or ''} ({p['phase']})",
                               total=p["total"] or None, completed=p["step"],
                               rate=f"{p['tokens_per_s']:.0f} tok/s" if p["tokens_per_s"] else "")
                done.wait(0.5)

    if _train_worker_alive(q):
        watch()
    else:
        # Nobody would pick the job up: train here, in the foreground (RQ wants the main thread).
        from rlfleet.worker.runner import run_worker

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            run_worker(cfg, "train", burst=True, handle=q)
        finally:
            done.set()
            watcher.join(timeout=5)
    run = store.get_run(run_id) if run_id else None
    if run is None:
        return {"ok": False, "message": "no training run found"}
    if run.state == "succeeded":
        return {"ok": True, "message": f"{run.version} is live", "version": run.version, "metrics": run.metrics}
    return {"ok": False, "message": f"run {run.id} {run.state}: {run.error or 'see rlfleet status'}",
            "version": run.version}


@app.command()
def rollback(
    version: Annotated[
        str | None, typer.Argument(help="Version to serve (v0003), or 'base'. Default: the parent.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve an earlier adapter version (instant)."""
    cfg = _config()
    with _queue(cfg) as q:
        _emit(dispatch(q, cfg, Command(name="rollback", args={"version": version})), as_json)


@app.command()
def promote(
    version: Annotated[str, typer.Argument(help="Version to serve (v0003).")],
    force: Annotated[bool, typer.Option("--force", help="Serve it even though the gate rejected it.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Serve a version; one the evaluation gate rejected only with --force."""
    cfg = _config()
    with _queue(cfg) as q:
        _emit(dispatch(q, cfg, Command(name="promote", args={"version": version, "force": force})), as_json)


@app.command()
def push(
    target: Annotated[str | None, typer.Option(help="Only this push target (its name in config.toml).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Push the served adapter to the configured inference servers now (vLLM, Ollama; LM Studio gets the
    manual step). The worker does this after every promotion; this is the retry."""
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.worker.push_schedule import run_push

    cfg = _config()
    if not cfg.push:
        raise BadInput("no push targets: add a [[push]] section to config.toml (see the README)")
    if target and target not in {t.name for t in cfg.push}:
        raise BadInput(f"no push target {target!r} (targets: {', '.join(t.name for t in cfg.push)})")
    with _queue(cfg) as q:
        result = run_push(cfg, AdapterRegistry(cfg.adapters_root, model_slug(cfg.model)), q.redis, target).to_dict()
    if not as_json:
        for r in result["results"]:
            mark = {True: "[green]ok[/]", False: "[red]failed[/]", None: "[yellow]manual step[/]"}[r["ok"]]
            out.print(f"{r['target']}: {mark} {escape(r['message'])}")
        if result["ok"]:
            return
        raise typer.Exit(2)
    _emit(result, as_json)


export_app = typer.Typer(help="Take the improved model or the ratings out of rlfleet.", no_args_is_help=True)
import_app = typer.Typer(help="Bring ratings in (from `rlfleet export ratings`).", no_args_is_help=True)
app.add_typer(export_app, name="export")
app.add_typer(import_app, name="import")
VersionOpt = Annotated[str | None, typer.Option("--version", help="Adapter version (default: the one served).")]


@export_app.command("adapter")
def export_adapter_cmd(dest: Annotated[Path, typer.Argument(help="New folder to write.")],
                       version: VersionOpt = None, as_json: JsonOpt = False) -> None:
    """A plain peft folder (adapter_config.json + adapter_model.safetensors) for PeftModel.from_pretrained."""
    from .export import export_adapter

    path, v = export_adapter(_config(read_only=True), dest, version)
    _emit({"ok": True, "message": f"wrote adapter {v} to {path}", "path": str(path), "version": v}, as_json)


@export_app.command("merged")
def export_merged_cmd(dest: Annotated[Path, typer.Argument(help="New folder to write.")],
                      version: VersionOpt = None, as_json: JsonOpt = False) -> None:
    """The base model with the adapter merged in (safetensors + tokenizer), for transformers and friends."""
    from .export import export_merged

    cfg = _config(read_only=True)
    with err.status(f"merging {version or 'the served adapter'} into {cfg.model}…"):
        path, v = export_merged(cfg, dest, version)
    _emit({"ok": True, "message": f"wrote {cfg.model} + {v} merged to {path}", "path": str(path), "version": v},
          as_json)


@export_app.command("ratings")
def export_ratings_cmd(
    dest: Annotated[Path, typer.Argument(help="JSONL file to write (a folder with --format datasets).")],
    all_states: Annotated[bool, typer.Option("--all", help="Also undone and replaced ratings.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="jsonl | datasets (Hugging Face, save_to_disk)")] = "jsonl",
    as_json: JsonOpt = False,
) -> None:
    """Every rating with its prompt and answer: TRL KTO's prompt / completion / label shape, plus the
    comment and provenance. Nothing is sent anywhere; the file is yours."""
    from .models import model_slug
    from .ratings_io import to_example, write_dataset, write_jsonl
    from .store import Store

    if fmt not in ("jsonl", "datasets"):
        raise BadInput(f"unknown --format {fmt!r}: use jsonl or datasets")
    cfg = _config(read_only=True)
    pairs = Store(cfg.db_url).rated_pairs(model_slug(cfg.model), all_states=all_states)
    examples = [to_example(r, c) for r, c in pairs]
    n = write_jsonl(examples, dest) if fmt == "jsonl" else write_dataset(examples, dest)
    _emit({"ok": True, "message": f"wrote {n} ratings to {dest}", "path": str(dest), "count": n}, as_json)


@import_app.command("ratings")
def import_ratings_cmd(src: Annotated[Path, typer.Argument(help="A JSONL file from `rlfleet export ratings`.")],
                       as_json: JsonOpt = False) -> None:
    """Add the ratings in SRC; lines already here, or invalid, are skipped and counted with the reason."""
    from .ratings_io import ImportReport, read_jsonl
    from .store import Store

    try:
        is_file = src.is_file()
    except OSError as exc:  # a name too long for the file system: is_file() raises instead of saying no
        raise BadInput(f"cannot read {src}: {exc.strerror}") from None
    if not is_file:
        raise BadInput(f"no file {src}")
    cfg = _config()
    store = Store(cfg.db_url)
    report = ImportReport()
    for ex in read_jsonl(src, report):
        why = store.import_example(ex)
        if why is None:
            report.imported += 1
        else:
            report.skipped[why] += 1
    skipped = ", ".join(f"{n} {why}" for why, n in report.skipped.items()) or "none"
    result = {"ok": True, "message": f"imported {report.imported} ratings; skipped: {skipped}", **report.as_dict()}
    if not as_json:
        for line in report.errors:
            err.print(f"[yellow]{escape(line)}[/]")
    _emit(result, as_json)


@app.command()
def events(
    dead: Annotated[bool, typer.Option("--dead", help="List the events the worker set aside.")] = False,
    retry: Annotated[bool, typer.Option("--retry", help="Put the set-aside events back in the queue.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """What waits in the events queue, and the events the worker failed on and set aside.

    An event the worker fails on (a bug, not a refusal and not a database outage) is tried 5 times and
    then set aside with its error, so it never holds up the events behind it; nothing is dropped.
    Fix the cause, then `rlfleet events --retry`.
    """
    from . import inbox
    from .queue import ensure_drain

    cfg = _config(read_only=True)
    with _queue(cfg) as q:
        requeued = inbox.requeue_dead(q.redis) if retry else 0
        if requeued:
            ensure_drain(q.redis)
            _work_if_nobody_does(q, cfg)  # as `rlfleet good` does: applied now, not when a worker starts
        aside = inbox.dead(q.redis)
        report = {"ok": True, "waiting": q.waiting_events(), "set_aside": len(aside), "requeued": requeued}
        if dead:
            report["dead"] = [_dead_line(d) for d in aside]
    if as_json:
        _emit(report, True)
        return
    out.print(f"{report['waiting']} events waiting, {report['set_aside']} set aside"
              + (f"; {requeued} put back in the queue" if retry else ""), markup=False)
    for d in report.get("dead", []):
        out.print(f"  {d['when']}  {d['type']} {d['event_id']} from {d['actor']}: {d['error']}", markup=False)


def _dead_line(d: dict) -> dict:
    """A set-aside event as a person reads it: which one and why, not its text (it may be private)."""
    try:
        ev = json.loads(d["event"])
    except (TypeError, ValueError):
        ev = {}
    ev = ev if isinstance(ev, dict) else {}
    return {"when": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.get("ts", 0))),
            "type": str(ev.get("type", "unreadable")), "event_id": str(ev.get("event_id", "?")),
            "actor": str(ev.get("actor", "?")), "error": one_line(str(d.get("error", "")))}


@app.command()
def history(as_json: JsonOpt = False) -> None:
    """Every adapter version: ratings used, held-out margin before/after, KL, accepted tokens, verdict."""
    cfg = _config(read_only=True)
    with _queue(cfg) as q:
        st = status_dict(cfg, q)
    versions = st["adapter"]["versions"]
    if as_json:
        out.print_json(json.dumps(history_rows(versions), default=str))
    elif not versions:
        out.print("no adapter versions yet")
    else:
        out.print(versions_table(versions))


@app.command()
def reset(
    purge_ratings: Annotated[bool, typer.Option("--purge-ratings", help="Also delete every rating.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Go back to the base model and start a fresh adapter lineage (ratings stay unless purged)."""
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput("reset needs --yes when not run interactively")
        what = "the base model, and DELETE all ratings" if purge_ratings else "the base model (ratings are kept)"
        if not typer.confirm(f"Reset to {what}?"):
            raise typer.Exit(1)
    cfg = _config()
    with _queue(cfg) as q:
        _emit(dispatch(q, cfg, Command(name="reset", args={"purge_ratings": purge_ratings})), as_json)


# ---- processes --------------------------------------------------------------------------------------


@app.command()
def worker(
    queue: Annotated[str, typer.Option("--queue", help="events | train | all")] = "all",
    burst: Annotated[bool, typer.Option(help="Quit when the queues are empty.")] = False,
) -> None:
    """Run one worker in the foreground (for scale-out: many events workers, one trainer per model)."""
    if queue not in ("events", "train", "all"):
        raise BadInput(f"unknown queue {queue!r}: use events, train or all")
    from rlfleet.worker.runner import run_worker

    cfg = _config()
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
    import logging

    from rlfleet.bots.runner import run_bot

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlfleet").setLevel(logging.INFO)
    run_bot(platform, _config(), http=http, host=host, port=port)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on. Anything but loopback exposes the model.")] = "",
    port: Annotated[int | None, typer.Option(help="Port (default: the one in responder.url, else 8000).")] = None,
) -> None:
    """Serve the local model (base + current adapter) as an OpenAI-compatible chat-completions API: what
    the bots answer with. A promotion or rollback is live on the next request."""
    import asyncio
    import logging
    from urllib.parse import urlparse

    from rlfleet.shared.models import resolve_model, serving_device
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.responder import LocalResponder
    from rlfleet.shared.serve import serve as serve_forever

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlfleet").setLevel(logging.INFO)
    cfg = _config()
    url = urlparse(cfg.responder.url)
    local = url.hostname in ("127.0.0.1", "localhost", "::1")
    host = host or "127.0.0.1"
    port = port if port is not None else (url.port if local and url.port else 8000)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/] listening on {host}: anyone who can reach it can use the model")
    ref = resolve_model(cfg.model)
    with err.status(f"loading {cfg.model}…"):
        responder = LocalResponder(
            ref, AdapterRegistry(cfg.adapters_root, ref.slug).dir, device=serving_device(cfg.train.device),
            max_new_tokens=cfg.chat.max_new_tokens, temperature=cfg.chat.temperature, top_p=cfg.chat.top_p,
            system_prompt=cfg.chat.system_prompt,
        )
    out.print(f"serving {cfg.model} ({responder.active_version or 'base'}) on http://{host}:{port}/v1")
    asyncio.run(serve_forever(responder, cfg.model, host, port))


@app.command()
def bridge(
    host: Annotated[str | None, typer.Option(help="Address (default 127.0.0.1; anything else is exposed).")] = None,
    port: Annotated[int | None, typer.Option(help="Port (default 8765).")] = None,
) -> None:
    """The signed local HTTP API for agents, hooks and gateways (OpenAPI at /openapi.json)."""
    import asyncio
    import logging

    from rlfleet.bridge.app import load_keys, make_app
    from rlfleet.shared.webserver import listening, until_cancelled

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlfleet").setLevel(logging.INFO)
    cfg = _config()
    host = host or cfg.bridge.host
    port = cfg.bridge.port if port is None else port
    keys = load_keys(cfg)
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(f"[yellow]warning:[/] the bridge listens on {host}: reachable from other machines")

    async def serve_bridge() -> None:
        with _queue(cfg) as q:
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


def children_panel(workers: Any, skipped: dict[str, str]) -> Table:
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
    from rlfleet.worker.runner import BackgroundWorkers

    cfg = _config(threshold=threshold)
    if write_secret(cfg.secret_path):  # a data dir made by `chat` has none yet, and the bridge needs it
        err.print(f"made secret file {escape(str(cfg.secret_path))} (mode 0600) for the bridge")
    bots = tuple(enabled_bots(cfg))
    serve = bool(bots) and _serves_locally(cfg)
    with _queue(cfg) as q:
        workers = BackgroundWorkers(cfg, bots=bots, serve=serve, bridge=True)
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
def chat(
    model: Annotated[str | None, typer.Option(help="Base model (overrides config).")] = None,
    threshold: Annotated[int | None, typer.Option(help="Ratings that start a training run.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Longest answer, in tokens.")] = None,
    no_worker: Annotated[bool, typer.Option("--no-worker", help="Do not start background workers.")] = False,
) -> None:
    """Chat with the local model in the terminal and rate each answer; training runs in the background."""
    from rlfleet.bots.terminal import run_chat

    cfg = _config(model=model, threshold=threshold)
    if max_new_tokens:
        cfg.chat.max_new_tokens = max_new_tokens
    run_chat(cfg, start_workers=not no_worker)


def _validation_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    return str(exc).splitlines()[0]
