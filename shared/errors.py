"""Errors a user can act on. Each carries one line that says what is wrong and, where known, the fix."""

from __future__ import annotations


class RlfleetError(Exception):
    """Base class: the CLI prints ``str(err)`` on one line and exits non-zero, no traceback."""

    exit_code = 1


class BadInput(RlfleetError):
    """Malformed or out-of-range input; nothing was changed."""

    exit_code = 2


class ContextTooLong(BadInput):
    """A conversation longer than the model reads at once: refused before any token is drawn (past its
    trained context a model answers nonsense, slowly)."""


class NotFound(RlfleetError):
    """The thing addressed (capture, version, model) does not exist."""

    exit_code = 3


class ConfigError(RlfleetError):
    exit_code = 4


class QueueUnavailable(RlfleetError):
    exit_code = 5


class ModelUnavailable(RlfleetError):
    exit_code = 6
