"""``rlfleet``: the terminal front end, and the composition root: the one package that imports from
``shared``, ``bots``, ``bridge`` and ``worker`` alike, and starts their processes (see :mod:`.fleet`).

One verb per command, ``--json`` where it prints data, errors on one line with the fix. Everything that
changes state goes through the queue as an event. The root, the entry point and the helpers every
command uses are in :mod:`.app`; each module below holds the commands of one job.
"""

from __future__ import annotations

# (`app` stays the module's name here: rlfleet.cli.app.app is the Typer root)
from . import app as _app
from .app import dispatch, main

# Importing a module registers its commands, in this order: the order of `rlfleet --help`.
# isort: off
from . import setup, rate, status, training, data, processes  # noqa: F401
# isort: on
_app.rewrap_help(_app.app)  # once every command is registered

__all__ = ["dispatch", "main"]
