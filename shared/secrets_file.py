"""Secrets (bot tokens, signing secrets, the bridge secret): from an env var or a 0600 file, never
from config.toml, never logged. Errors name where a secret was looked for, never its value."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Literal, overload

from .errors import ConfigError

MAX_SECRET_BYTES = 4096


def read_secret_file(path: Path, what: str) -> str:
    """The stripped contents of ``path``; refused when group or others may read it."""
    path = Path(path).expanduser()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what}: no file {path}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what}: {path} is readable by others; run `chmod 600 {path}`")
    if st.st_size > MAX_SECRET_BYTES:
        raise ConfigError(f"{what}: {path} is {st.st_size} bytes, not a secret")
    value = path.read_text(encoding="utf-8").strip()
    if not value:
        raise ConfigError(f"{what}: {path} is empty")
    return value


@overload
def read_secret(env: str | None, file: Path | None, what: str, required: Literal[True] = True) -> str: ...


@overload
def read_secret(env: str | None, file: Path | None, what: str, required: bool) -> str | None: ...


def read_secret(env: str | None, file: Path | None, what: str, required: bool = True) -> str | None:
    """``$env`` if set, else the 0600 ``file`` if given; a clear error (or None) when neither has it."""
    if env and os.environ.get(env, "").strip():
        return os.environ[env].strip()
    if file is not None:
        return read_secret_file(file, what)
    if not required:
        return None
    where = f"set ${env}" if env else "give a file"
    raise ConfigError(f"{what} is not set: {where} (or point the config at a 0600 file)")


class _Redact(logging.Filter):
    """Replaces known secret values in every log record (SDKs log request URLs, and Telegram's carry
    the bot token in the path)."""

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if len(s) >= 6]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if any(s in message for s in self.secrets):
            for s in self.secrets:
                message = message.replace(s, "***")
            record.msg, record.args = message, None
        return True


def redact_in_logs(*secrets: str | None) -> None:
    """Keep these values out of every log line from now on (root handlers, so SDK loggers too)."""
    flt = _Redact([s for s in secrets if s])
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig()
    for handler in root.handlers:
        handler.addFilter(flt)
