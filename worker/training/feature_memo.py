"""The reward model's features of answers, remembered between runs under the model that computed them.

A run's reward model reads the user's earlier ratings (up to a few hundred) beside its own, each as
its answer's pooled last hidden state under the policy the run starts from: the version being served.
Neither those answers nor that version change between runs, so the training worker computes their
features while it waits for the next run (worker/idle_work.py) and the run reads them from here
instead of running the model over them again (:mod:`.reward_features`).

Rows are remembered under the model they were computed with: the adapter folder (its path, and its
weights file's size and modification time: a version folder written again after a reset is another
model) and the session's precision. The newest few models' rows are kept: the served version's, and
those of the scopes a worker trains.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from rlfleet.shared.registry import ADAPTER_WEIGHTS

from ..batching import Encoded

KEEP_MODELS = 4  # models whose rows stay remembered: the served version's and a few scopes'
KEEP_ROWS = 4096  # rows per model (a run reads at most a few hundred earlier ratings)

Identity = tuple[str, ...]
RowKey = tuple[int, tuple[int, ...]]
Rows = dict[RowKey, list[float]]

_MEMOS: weakref.WeakKeyDictionary[Any, OrderedDict[Identity, Rows]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def identity(adapter_dir: Path | None, precision: str) -> Identity:
    """What a row's features depend on besides its tokens: the adapter (None: the base, which a fresh
    LoRA is until its first update) and the session's precision."""
    if adapter_dir is None:
        return ("base", precision)
    folder = Path(adapter_dir).resolve()
    try:
        st = (folder / ADAPTER_WEIGHTS).stat()
    except OSError:
        return ("unreadable", str(folder), precision)  # nothing computed under it is ever found again
    return (str(folder), str(st.st_size), str(st.st_mtime_ns), precision)


def row_key(e: Encoded) -> RowKey:
    """A row as the features see it: its tokens, and where its answer starts (what is pooled)."""
    return e.prompt_len, tuple(e.input_ids)


def rows_for(backend: Any, adapter_dir: Path | None, precision: str) -> Rows:
    """The remembered rows of ``backend``'s model with the adapter in ``adapter_dir`` at ``precision``,
    as a dict the caller reads and adds to (the process's own: nothing is shared between workers)."""
    key = identity(adapter_dir, precision)
    with _LOCK:
        models = _MEMOS.setdefault(backend, OrderedDict())
        rows = models.setdefault(key, {})
        models.move_to_end(key)
        while len(models) > KEEP_MODELS:
            models.popitem(last=False)
        if len(rows) > KEEP_ROWS:  # oldest first: dicts keep insertion order
            for stale in list(rows)[: len(rows) - KEEP_ROWS]:
                del rows[stale]
        return rows


def forget(backend: Any) -> None:
    """Drop every remembered row of ``backend`` (tests; a worker never needs to)."""
    with _LOCK:
        _MEMOS.pop(backend, None)
