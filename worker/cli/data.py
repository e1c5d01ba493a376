"""What the data dir holds: ``rlfleet events`` (the queue and what the worker set aside), ``history``
(every adapter version), ``reset``, and ``export`` / ``import`` of adapters and ratings."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import Command
from rlfleet.shared.queue import queue_for
from rlfleet.shared.status import status_dict
from rlfleet.shared.status_view import history_rows, versions_table

from .app import (
    JsonOpt,
    ScopeOpt,
    app,
    command_config,
    dispatch,
    emit,
    err,
    known_scope,
    one_line,
    out,
    scope_arg,
    work_if_nobody_does,
)

export_app = typer.Typer(help="Take the improved model or the ratings out of rlfleet.", no_args_is_help=True)
import_app = typer.Typer(help="Bring ratings in (from `rlfleet export ratings`).", no_args_is_help=True)
app.add_typer(export_app, name="export")
app.add_typer(import_app, name="import")
VersionOpt = Annotated[str | None, typer.Option("--version", help="Adapter version (default: the one served).")]


@export_app.command("adapter")
def export_adapter_cmd(dest: Annotated[str, typer.Argument(help="New (or empty) folder to write.")],
                       version: VersionOpt = None, as_json: JsonOpt = False) -> None:
    """A plain peft folder (adapter_config.json + adapter_model.safetensors) for PeftModel.from_pretrained."""
    from rlfleet.shared.export import check_target, export_adapter

    target = check_target(_dest_path(dest), "folder")
    path, v = export_adapter(command_config(read_only=True), target, version)
    emit({"ok": True, "message": f"wrote adapter {v} to {path}", "path": str(path), "version": v}, as_json)


@export_app.command("merged")
def export_merged_cmd(dest: Annotated[str, typer.Argument(help="New (or empty) folder to write.")],
                      version: VersionOpt = None, as_json: JsonOpt = False) -> None:
    """The base model with the adapter merged in (safetensors + tokenizer), for transformers and friends."""
    from rlfleet.shared.export import check_target, export_merged

    target = check_target(_dest_path(dest), "folder")  # before the seconds the model takes to load
    cfg = command_config(read_only=True)
    with err.status(f"merging {version or 'the served adapter'} into {cfg.model}…"):
        path, v = export_merged(cfg, target, version)
    emit({"ok": True, "message": f"wrote {cfg.model} + {v} merged to {path}", "path": str(path), "version": v},
          as_json)


@export_app.command("ratings")
def export_ratings_cmd(
    dest: Annotated[str, typer.Argument(help="JSONL file to write (a new or empty folder with --format datasets).")],
    all_states: Annotated[bool, typer.Option("--all", help="Also undone and replaced ratings.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="jsonl | datasets (Hugging Face, save_to_disk)")] = "jsonl",
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file (a folder is never "
                                        "replaced: --format datasets writes a new or empty one).")] = False,
    scope: ScopeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every rating with its prompt and answer: TRL KTO's prompt / completion / label shape, plus the
    comment and provenance (every scope's: --scope for one). Nothing is sent anywhere; the file is yours."""
    from rlfleet.shared import scopes
    from rlfleet.shared.export import check_target
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.ratings_io import to_example, write_dataset, write_jsonl
    from rlfleet.shared.store import Store

    if fmt not in ("jsonl", "datasets"):
        raise BadInput(f"unknown --format {fmt!r}: use jsonl or datasets")
    scope_arg(scope)  # the syntax first, before anything is read
    target = check_target(_dest_path(dest), "file" if fmt == "jsonl" else "folder", force)
    cfg = command_config(read_only=True)
    key = known_scope(cfg, scope)
    slug = model_slug(cfg.model)
    pairs = Store(cfg.db_url).rated_pairs(scopes.lineage(slug, key or scopes.SHARED), all_states=all_states,
                                          with_scopes=key is None)
    examples = [to_example(r, c) for r, c in pairs]
    n = write_jsonl(examples, target, force) if fmt == "jsonl" else write_dataset(examples, target)
    emit({"ok": True, "message": f"wrote {n} ratings to {target}", "path": str(target), "count": n}, as_json)


def _dest_path(text: str) -> Path:
    """An export's destination as typed (a str: typer makes an empty Path argument ".", the current folder)."""
    if not text.strip():
        raise BadInput("the destination is empty: give the path of the file or folder to write")
    return Path(text)


@import_app.command("ratings")
def import_ratings_cmd(src: Annotated[Path, typer.Argument(
        help="A JSONL file, or a datasets folder, from `rlfleet export ratings`.")], as_json: JsonOpt = False) -> None:
    """Add the ratings in SRC; lines already here, or invalid, are skipped and counted with the reason."""
    from rlfleet.shared.ratings_io import ImportReport, read_dataset, read_jsonl
    from rlfleet.shared.store import Store

    try:
        is_file, is_dir = src.is_file(), src.is_dir()
    except OSError as exc:  # a name too long for the file system: is_file() raises instead of saying no
        raise BadInput(f"cannot read {src}: {exc.strerror}") from None
    if not (is_file or is_dir):
        raise BadInput(f"no file or folder {src}")
    cfg = command_config()
    store = Store(cfg.db_url)
    report = ImportReport()
    for ex in (read_jsonl if is_file else read_dataset)(src, report):
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
    emit(result, as_json)
    if report.skipped.get("invalid"):  # the valid ones are in; a script still learns that some were not
        raise typer.Exit(1)


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
    from rlfleet.shared import inbox
    from rlfleet.shared.queue import ensure_drain

    cfg = command_config(read_only=True)
    with queue_for(cfg) as q:
        requeued = inbox.requeue_dead(q.redis) if retry else 0
        if requeued:
            ensure_drain(q.redis)
            work_if_nobody_does(q, cfg)  # as `rlfleet good` does: applied now, not when a worker starts
        aside = inbox.dead(q.redis)
        report: dict[str, Any] = {"ok": True, "waiting": q.waiting_events(), "set_aside": len(aside),
                                  "requeued": requeued}
        if dead:
            report["dead"] = [_dead_line(d) for d in aside]
    if as_json:
        emit(report, True)
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
def history(as_json: JsonOpt = False, scope: ScopeOpt = None) -> None:
    """Every adapter version: ratings used (+ replayed), held-out margin before/after, KL, accepted tokens, verdict."""
    cfg = command_config(read_only=True)
    with queue_for(cfg) as q:
        st = status_dict(cfg, q, known_scope(cfg, scope))
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
    scope: ScopeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Go back to the base model and start a fresh adapter lineage (ratings stay unless purged)."""
    scope_arg(scope)
    cfg = command_config(must_exist=True)
    key = known_scope(cfg, scope)
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput("reset needs --yes when not run interactively")
        what = "the base model, and DELETE all ratings" if purge_ratings else "the base model (ratings are kept)"
        if not typer.confirm(f"Reset to {what}?"):
            raise typer.Exit(1)
    with queue_for(cfg) as q:
        args = {"purge_ratings": purge_ratings, **({"scope": key} if key else {})}
        emit(dispatch(q, cfg, Command(name="reset", args=args)), as_json)


@app.command()
def forget(
    person: Annotated[str, typer.Argument(help="SOURCE:ID: the platform and its own user id, e.g. slack:U024BE7LH "
                                               "(cli:local for this machine's user).")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete one person's data: their ratings, the answers given to them (with any rating of those), and
    their own adapter (docs/scopes.md), then say what was deleted and what already learned from it."""
    from typing import get_args

    from rlfleet.shared.events import Source
    from rlfleet.shared.forget import Busy
    from rlfleet.shared.forget import forget as forget_person
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.store import Store

    source, sep, actor = person.partition(":")
    if not sep or source not in get_args(Source) or not actor.strip():
        raise BadInput(f"{person[:80]!r} is not SOURCE:ID (the source one of {', '.join(get_args(Source))})")
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput("forget needs --yes when not run interactively")
        if not typer.confirm(f"DELETE every rating, answer and adapter of {source}:{actor}?"):
            raise typer.Exit(1)
    cfg = command_config(must_exist=True)  # a misspelt --home has no one to forget
    try:
        done = forget_person(Store(cfg.db_url), cfg.adapters_root, model_slug(cfg.model), source, actor)
    except Busy as exc:
        raise BadInput(str(exc)) from None
    emit({"ok": True, "message": done.message(), **done.as_dict()}, as_json)
