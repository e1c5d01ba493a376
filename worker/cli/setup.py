"""``rlfleet init`` and ``rlfleet uninstall``: the config file, the secret, the chat platforms' bots and
the coding agents' hooks."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from rlfleet.shared.config import Config, load_config
from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import PLATFORMS, describe_validation_error

from .app import app, command_config, err, out


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
        help="PLATFORM:USER_ID allowed /rl train, rollback, reset, pause, resume (repeatable).")] = None,
    rater: Annotated[list[str] | None, typer.Option(
        help="PLATFORM:USER_ID allowed to rate answers given to others (repeatable).")] = None,
    agent: Annotated[list[str] | None, typer.Option(
        help="Install hooks in a coding agent: claude-code or codex (repeatable). Its answers are captured, "
             "and /rl good typed in it rates them.")] = None,
) -> None:
    """Write config.toml and the secret file in the data dir, and check the model loads."""
    cfg = command_config()
    if agent:
        from rlfleet.bridge.agents import check

        for name in agent:  # before anything is written: an unknown agent, or a settings file we cannot edit
            check(name)
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
    from rlfleet.shared.models import resolve_model

    ref = resolve_model(new.model)
    if check_model:
        with err.status(f"loading {new.model} to check it works…"):
            from rlfleet.shared.models import load_model, load_tokenizer

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
        for key, what in (("admins", "user ids allowed /rl train, rollback, reset, pause, resume"),
                          ("raters", "user ids allowed to rate answers given to others")):
            answer = typer.prompt(f"{name}: {what} (comma-separated, '-' for none)",
                                  default=",".join(section[key]) or "-")
            section[key] = [] if answer.strip() == "-" else _split_ids(answer)
