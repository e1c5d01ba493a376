"""The data dir a command runs on: refused when it can never be one, made when a command that writes
needs it (the caller says so), refused when a command that only reads would leave an empty one behind."""

from __future__ import annotations

from pathlib import Path

from .errors import BadInput


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


def open_home(path: Path, read_only: bool) -> bool:
    """The data dir for a command; True when it was made just now. Commands that write make a missing
    one (a misspelt --home would otherwise quietly start an empty one, so the caller says it did);
    commands that only read refuse it instead of leaving an empty data dir behind."""
    if path.is_dir():
        return False
    if read_only:
        raise BadInput(f"no data dir at {path}: `rlfleet chat` or `rlfleet init` makes one "
                       "(or check --home / $RLFLEET_HOME for a typo)")
    try:
        path.mkdir(parents=True)
    except OSError as exc:
        raise BadInput(f"cannot make data dir {path}: {exc.strerror}") from None
    return True
