"""What a run computes before its first update, remembered between runs under the model that computed it.

A run's reward model reads the user's ratings (its own and up to a few hundred earlier ones), each as
its answer's pooled last hidden state under the policy the run starts from: the version being served.
It then explores: it samples answers to the newest rated prompts from that policy and pools them too,
and its reference and run-start passes read every row's log-probs under the base and that policy.
None of that depends on anything but the answers and the version, so the training worker computes it
while it waits for the next run (worker/idle_work.py), and the run reads it from here instead of
running the model again (:mod:`.reward_features`, :mod:`.exploration`, the torch trainer's log-probs).

Everything is remembered under the model it was computed with: the adapter folder (its path, and its
weights file's size and modification time: a version folder written again after a reset is another
model) and the session's precision. The newest few models' are kept: the served version's, the base's,
and those of the scopes a worker trains.
"""

from __future__ import annotations

import json
import threading
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.shared.registry import ADAPTER_WEIGHTS

from ..batching import Encoded

KEEP_MODELS = 6  # models remembered: the served version's, the base's and a few scopes'
KEEP_ROWS = 4096  # rows per model and table (a run reads at most a few hundred earlier ratings)

Identity = tuple[str, ...]
RowKey = tuple[int, tuple[int, ...]]
Rows = dict[RowKey, list[float]]
# A prompt's drawn answers: exploration's (the prompt as JSON, how many, max new tokens, seed), or the
# gate's ("held", the prompt as JSON, max new tokens, temperature, top-p, seed) -> their token ids.
DrawKey = tuple[Hashable, ...]
Draws = dict[DrawKey, list[list[int]]]
BASE_DRAWS: Identity = ("base", "drawn")  # the base's drawn answers: the same in any session precision


@dataclass
class Memo:
    """One model's remembered rows: each answer's pooled last hidden state (the reward model's
    features), each row's response log-probs (the torch trainer's reference and run-start passes read
    them), and the answers drawn to explore each prompt."""

    pooled: Rows = field(default_factory=dict)
    logprobs: Rows = field(default_factory=dict)
    drawn: Draws = field(default_factory=dict)

    def trim(self) -> None:
        for table in (self.pooled, self.logprobs, self.drawn):
            _trim(table)


def _trim(table: dict[Any, Any]) -> None:
    if len(table) > KEEP_ROWS:  # oldest first: dicts keep insertion order
        for stale in list(table)[: len(table) - KEEP_ROWS]:
            del table[stale]


_MEMOS: weakref.WeakKeyDictionary[Any, OrderedDict[Identity, Memo]] = weakref.WeakKeyDictionary()
# Per backend and lineage, what the worker's idle work last finished for (worker/idle_work.py).
_DONE: weakref.WeakKeyDictionary[Any, dict[str, Hashable]] = weakref.WeakKeyDictionary()
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
    """The remembered pooled rows of ``backend``'s model with the adapter in ``adapter_dir`` at
    ``precision``, as a dict the caller reads and adds to (the process's own: nothing is shared between
    workers)."""
    return memo_for(backend, adapter_dir, precision).pooled


def memo_for(backend: Any, adapter_dir: Path | None, precision: str) -> Memo:
    """Everything remembered of ``backend``'s model with the adapter in ``adapter_dir`` at ``precision``."""
    memo = memo_of(backend, identity(adapter_dir, precision))
    assert memo is not None  # (made when missing)
    return memo


def memo_of(backend: Any, key: Identity, create: bool = True) -> Memo | None:
    """Everything remembered of ``backend``'s model under :func:`identity` ``key`` (None: nothing is,
    and ``create`` is off: a look-up that finds nothing does not push a model out)."""
    with _LOCK:
        models = _MEMOS.setdefault(backend, OrderedDict())
        if key not in models and not create:
            return None
        memo = models.setdefault(key, Memo())
        models.move_to_end(key)
        while len(models) > KEEP_MODELS:
            models.popitem(last=False)
        memo.trim()
        return memo


def prompt_seed(prompt: list[dict], seed: int, i: int = 0) -> int:
    """The seed of the ``i``-th answer drawn ahead for ``prompt`` from a run's or the gate's ``seed``:
    the same whenever, and in whichever batch, it is drawn."""
    return (seed + zlib.crc32(json.dumps(prompt, sort_keys=True).encode()) + i) % 2**31


def base_draws(backend: Any) -> Draws:
    """The gate's answers drawn from ``backend``'s base model, per prompt (a draw runs in fp32 or on
    llama.cpp's file whatever precision a session trains in, so one table serves them all)."""
    memo = memo_of(backend, BASE_DRAWS)
    assert memo is not None  # (made when missing)
    return memo.drawn


def done_for(backend: Any) -> dict[str, Hashable]:
    """Per lineage, what the idle work last did everything for with ``backend`` (read and set by
    worker/idle_work.py; dropped with the rows by :func:`forget`)."""
    with _LOCK:
        return _DONE.setdefault(backend, {})


def forget(backend: Any) -> None:
    """Drop every remembered row of ``backend`` (tests; a worker never needs to)."""
    with _LOCK:
        _MEMOS.pop(backend, None)
        _DONE.pop(backend, None)
