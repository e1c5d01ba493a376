"""``rlfleet train``, ``pause``, ``resume``, ``rollback``, ``promote`` and ``push``: training runs and the
version served."""

from __future__ import annotations

import signal
import subprocess
from typing import Annotated

import typer
from rich.markup import escape

from rlfleet.shared.config import Config
from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import Command
from rlfleet.shared.queue import QueueHandle, queue_for

from .app import JsonOpt, ScopeOpt, app, command_config, dispatch, emit, err, known_scope, out, scope_arg


def _args(cfg: Config, scope: str | None, **args: object) -> dict:
    """A command's arguments, with the scope whose adapter it acts on (docs/scopes.md) when given: one
    this data dir holds."""
    key = known_scope(cfg, scope)
    return {**args, **({"scope": key} if key is not None else {})}


@app.command()
def train(
    wait: Annotated[bool, typer.Option(
        "--wait", help="Stay until the run ends; with no training worker running, start one for the run.")] = False,
    scope: ScopeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Start a training run now on the pending ratings (below the threshold too)."""
    scope_arg(scope)  # its syntax before the data dir is opened
    cfg = command_config()
    args = _args(cfg, scope)
    with queue_for(cfg) as q:
        result = dispatch(q, cfg, Command(name="train", args=args))
        if not (wait and result.get("ok")):
            if result.get("ok") and not as_json and not _train_worker_alive(q):
                result["message"] += "; it runs when `rlfleet up` or `rlfleet chat` is running (or use --wait)"
            emit(result, as_json)
            return
        emit(_wait_for_training(cfg, q, as_json, args.get("scope")), as_json)


def _train_worker_alive(handle: QueueHandle) -> bool:
    from rlfleet.shared.queue import TRAIN_QUEUE
    from rlfleet.shared.workers import serving

    return serving(handle.redis, TRAIN_QUEUE)


def _wait_for_training(cfg: Config, q: QueueHandle, quiet: bool, scope: object = None) -> dict:
    import threading

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rlfleet.shared import scopes
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.status import training_state
    from rlfleet.shared.store import Store

    slug = scopes.lineage(model_slug(cfg.model), str(scope or scopes.SHARED))
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

    died: str | None = None  # why our own training worker stopped before the run could end
    if _train_worker_alive(q):
        watch()
    else:
        # Nobody would pick the job up: a training worker of our own works the queue until it is empty,
        # started as `rlfleet chat` starts its trainer (a process of its own, on the malloc it preloads:
        # shared/allocator.py) and stopped with this command.
        from .fleet import BackgroundWorkers

        trainer = BackgroundWorkers(cfg, which=("train",), burst=True)
        trainer.start(supervise=False)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            exit_code = _worked_through(trainer.procs["train"])
        finally:
            done.set()
            watcher.join(timeout=5)
            trainer.stop()  # (stopped now: the run is let go, and the next worker's recovery queues it again)
        if exit_code:
            died = (f"the training worker exited with code {exit_code} before the run ended: "
                    f"see {trainer.log_path('train')}")
    run = store.get_run(run_id) if run_id else None
    if run is not None and run.state in ("queued", "running") and died:
        return {"ok": False, "message": died, "version": run.version}
    if run is None:
        return {"ok": False, "message": "no training run found"}
    if run.state == "succeeded":
        return {"ok": True, "message": f"{run.version} is live", "version": run.version, "metrics": run.metrics}
    return {"ok": False, "message": f"run {run.id} {run.state}: {run.error or 'see rlfleet status'}",
            "version": run.version}


def _worked_through(worker: subprocess.Popen) -> int | None:
    """``worker``'s exit code once it has worked the queue, None where Ctrl-C stopped it: a first Ctrl-C
    asks it to finish the run in hand and quit (one SIGTERM: RQ's warm stop), a second stops it now."""
    # Python's own handler, not RQ's, which this process keeps from applying the command's events itself
    # (it would turn a second Ctrl-C into a quiet exit)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            return worker.wait()
        except KeyboardInterrupt:
            err.print("finishing the run in hand, then stopping (Ctrl-C again to stop now)")
            worker.send_signal(signal.SIGTERM)
        try:
            return worker.wait()
        except KeyboardInterrupt:
            return None
    finally:
        signal.signal(signal.SIGINT, previous)


@app.command()
def rollback(
    version: Annotated[
        str | None, typer.Argument(help="Version to serve (v0003, v3 or 3), or 'base'. Default: the parent.")
    ] = None,
    scope: ScopeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve an earlier adapter version (instant)."""
    scope_arg(scope)  # its syntax before the data dir is opened
    cfg = command_config(must_exist=True)
    args = _args(cfg, scope, version=version)
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, Command(name="rollback", args=args)), as_json)


@app.command()
def pause(scope: ScopeOpt = None, as_json: JsonOpt = False) -> None:
    """Pause automatic training: ratings are still recorded, but no run starts by itself when they reach
    the threshold (`rlfleet train` still starts one). Lasts across restarts, until `rlfleet resume`."""
    scope_arg(scope)  # its syntax before the data dir is opened
    cfg = command_config()
    args = _args(cfg, scope)
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, Command(name="pause", args=args)), as_json)


@app.command()
def resume(scope: ScopeOpt = None, as_json: JsonOpt = False) -> None:
    """Resume automatic training; a run starts at once if the pending ratings already reach the threshold."""
    scope_arg(scope)  # its syntax before the data dir is opened
    cfg = command_config()
    args = _args(cfg, scope)
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, Command(name="resume", args=args)), as_json)


@app.command()
def promote(
    version: Annotated[str, typer.Argument(help="Version to serve (v0003, v3 or 3).")],
    force: Annotated[bool, typer.Option("--force", help="Serve it even though the gate rejected it.")] = False,
    scope: ScopeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Serve a version; one the evaluation gate rejected only with --force."""
    scope_arg(scope)  # its syntax before the data dir is opened
    cfg = command_config(must_exist=True)
    args = _args(cfg, scope, version=version, force=force)
    with queue_for(cfg) as q:
        emit(dispatch(q, cfg, Command(name="promote", args=args)), as_json)


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

    cfg = command_config()
    if not cfg.push:
        raise BadInput("no push targets: add a [[push]] section to config.toml (see the README)")
    if target and target not in {t.name for t in cfg.push}:
        raise BadInput(f"no push target {target!r} (targets: {', '.join(t.name for t in cfg.push)})")
    with queue_for(cfg) as q:
        result = run_push(cfg, AdapterRegistry(cfg.adapters_root, model_slug(cfg.model)), q.redis, target).to_dict()
    if not as_json:
        for r in result["results"]:
            mark = {True: "[green]ok[/]", False: "[red]failed[/]", None: "[yellow]manual step[/]"}[r["ok"]]
            out.print(f"{r['target']}: {mark} {escape(r['message'])}")
        if result["ok"]:
            return
        raise typer.Exit(2)
    emit(result, as_json)
