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

from .config import Config, load_config
from .errors import BadInput, RlfleetError
from .events import Capture, Command, Message, Rating, Undo, describe_validation_error
from .queue import EVENTS_QUEUE, QueueHandle, enqueue_event, open_queue, wait_for

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
        Path | None, typer.Option("--home", help="Data dir (default: $RLFLEET_HOME or ~/.rlfleet).")
    ] = None,
) -> None:
    if home is not None:
        os.environ["RLFLEET_HOME"] = str(home.expanduser().resolve())


def _config(**overrides: Any) -> Config:
    # Flags travel as env vars so the workers this process starts (or runs inline) see the same values.
    if overrides.get("threshold") is not None:
        os.environ["RLFLEET_THRESHOLD"] = str(overrides["threshold"])
    if overrides.get("model"):
        os.environ["RLFLEET_MODEL"] = str(overrides["model"])
    if overrides.get("preset"):
        os.environ["RLFLEET_PRESET"] = str(overrides["preset"])
    return load_config()


def _events_worker_alive(handle: QueueHandle) -> bool:
    from rq import Worker

    return any(EVENTS_QUEUE in w.queue_names() for w in Worker.all(connection=handle.redis))


def dispatch(handle: QueueHandle, cfg: Config, event: Any, timeout: float = 15.0) -> dict:
    """Enqueue an event and return what the worker made of it.

    With no events worker alive (nothing running), the queue is worked right here, so commands
    work on their own; the event is in Redis (append-only) before anything else happens.
    """
    job = enqueue_event(handle, event)
    if not _events_worker_alive(handle):
        from rlfleet.worker.runner import run_worker

        run_worker(cfg, "events", burst=True, handle=handle)
    result = wait_for(job, timeout)
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
        out.print(result.get("message", "ok"))
        if result.get("training"):
            out.print(f"[cyan]{result['training']}[/]")
    if not result.get("ok"):
        if not as_json:
            err.print(f"[red]error:[/] {result.get('message', 'failed')}")
        raise typer.Exit(2)


def _stop_on_signal(signum: int, _frame: object) -> None:
    # A `kill` or a closed terminal must unwind like Ctrl-C: workers stopped, the embedded Redis
    # released (an orphaned server would outlive us). RQ's own worker installs its own handlers.
    raise KeyboardInterrupt


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    try:
        app()
    except RlfleetError as exc:
        err.print(f"[red]error:[/] {exc}")
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


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
) -> None:
    """Write config.toml and the secret file in the data dir, and check the model loads."""
    cfg = load_config()
    interactive = sys.stdin.isatty() and not yes
    if interactive:
        model = model or typer.prompt("Base model (smollm2-135m, a local folder, or org/name)", default=cfg.model)
        preset = preset or typer.prompt("Preset (careful / balanced / aggressive)", default=cfg.train.preset)
        threshold = threshold or typer.prompt("Ratings per training run", default=cfg.train.threshold, type=int)
    data = cfg.model_dump(exclude={"home"})
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
    out.print("next: [bold]rlfleet chat[/]  or  [bold]rlfleet up[/]")


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
    t.add_row("workers", str(st["workers"]))
    versions = st["adapter"]["versions"]
    if not versions:
        return Group(t)
    return Group(t, versions_table(versions[-10:], title="versions (newest last)"))


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
    cfg = _config()
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
    from rq import Worker

    from .queue import TRAIN_QUEUE

    return any(TRAIN_QUEUE in w.queue_names() for w in Worker.all(connection=handle.redis))


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
def history(as_json: JsonOpt = False) -> None:
    """Every adapter version: ratings used, held-out margin before/after, KL, accepted tokens, verdict."""
    cfg = _config()
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
def up(
    threshold: Annotated[int | None, typer.Option(help="Ratings that start a training run.")] = None,
) -> None:
    """Start Redis (embedded when no REDIS_URL) and the workers, with a live status panel. Ctrl-C stops."""
    from rich.live import Live

    from rlfleet.worker.runner import BackgroundWorkers

    cfg = _config(threshold=threshold)
    with _queue(cfg) as q:
        workers = BackgroundWorkers(cfg)
        workers.start()
        try:
            with Live(console=out, refresh_per_second=2, transient=False) as live:
                while True:
                    st = status_dict(cfg, q)
                    alive = workers.alive()
                    grid = Table.grid()
                    grid.add_row(render_status(st))
                    dead = [n for n, ok in alive.items() if not ok]
                    if dead:
                        grid.add_row(f"[red]worker stopped: {', '.join(dead)} (see {workers.log_dir})[/]")
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
