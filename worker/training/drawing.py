"""Which kernels draw the answers a run samples: llama.cpp where the weights are saved ones.

A run samples answers at three points: exploration (from the policy it starts from, before any
step), the gate (from the base and from a saved candidate) and the loop checks (from the policy as it
trains). Where ``chat.engine`` lets llama.cpp draw the chat's tokens (a GGUF model on a CPU, with
llama-cpp-python installed), it draws these too: the weights are the base or an adapter folder on
disk (the loop checks' are saved to a private folder first: the backend's ``sample``), which
llama.cpp applies as it does for the chat, on the file's quantised weights, dropping each answer from
the batch as it ends, and decoding a prompt the batch asks several times once (bench/RESULTS.md,
``bench.time_to_adapter``). Elsewhere the trainer's own model draws (:mod:`.decoding`).

Nothing a run trains on depends on which kernels drew an answer beyond what was drawn: a run computes
the behaviour log-probs of the answers its starting policy drew in its own numerics
(docs/objective.md, "Behaviour"), and the gate reads sampled answers for their words (repetition,
distinct bigrams, length), not their log-probs. What llama.cpp draws differs from torch's draws only
by its quantised products (``tests/test_llamacpp_engine.py`` bounds that gap).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from rlfleet.shared import llamacpp_engine

log = logging.getLogger(__name__)


class _Live:
    def __repr__(self) -> str:
        return "LIVE"


# Rows llama.cpp draws in one batch: a CPU's batched rate rises up to about this many answers and no
# further (bench/RESULTS.md, "the gate's answers in one batch"), and the gate draws this many.
DRAW_BATCH = 32

# The weights in use are no saved folder's: a run has stepped since it loaded or saved them.
LIVE: Final = _Live()
Weights = Path | None | _Live  # a saved adapter folder, None (the base) or LIVE


class Drawer:
    """The llama.cpp engine of a trainer's model, made on first use; ``draw`` answers None where torch
    must draw (the choice is ``torch``, the model cannot run on llama.cpp, the weights are LIVE, or
    llama.cpp cannot take this request: said once per reason)."""

    def __init__(self, ref: Any, device: str, end_ids: Sequence[int]) -> None:
        self.ref, self.device = ref, device
        self.end_ids = list(end_ids)
        self.choice = "torch"
        self._engine: Any = None
        self._asked = False  # engine_for was asked for this choice (None then means: torch)
        self._lock = threading.Lock()  # the worker's preload thread may make it while a run asks for it
        self._said: set[str] = set()
        self.drawn = 0  # answers llama.cpp drew, over the drawer's life (what the tests and benchmarks read)

    def choose(self, choice: str) -> None:
        """Draw with ``choice`` (``chat.engine``: auto, torch or llama.cpp) from now on."""
        if choice not in llamacpp_engine.ENGINES:
            raise ValueError(f"unknown engine {choice!r}: one of {', '.join(llamacpp_engine.ENGINES)}")
        if choice != self.choice:
            self.close()
            self.choice = choice

    @property
    def loaded(self) -> bool:
        """Whether llama.cpp is loaded (it is made at the first draw, or by :meth:`load`)."""
        return self._engine is not None

    @property
    def engine(self) -> str:
        """What draws from saved weights: ``llama.cpp`` or ``torch`` (asks for the engine)."""
        return "llama.cpp" if self._get() is not None else "torch"

    def load(self) -> None:
        """Make the engine now rather than at the first draw (the training worker's preload)."""
        self._get()

    def _get(self) -> Any:
        with self._lock:
            if not self._asked:
                self._engine = llamacpp_engine.engine_for(self.ref, self.choice, self.device, max_adapters=4,
                                                           max_batch=DRAW_BATCH)
                self._asked = True
            return self._engine

    def draw(self, prompts: Sequence[list[int]], max_new_tokens: int, seed: int, temperature: float,
             top_p: float, weights: Weights, seeds: Sequence[int] | None = None) -> list[list[int]] | None:
        """Each prompt's new ids, without the end token, drawn by llama.cpp from ``weights`` (row ``i``
        seeded ``seeds[i]``, or ``seed + i`` without them); None: torch draws them."""
        if isinstance(weights, _Live) or not prompts:
            return None
        engine = self._get()
        if engine is None:
            return None
        own = list(seeds) if seeds is not None else [seed + i for i in range(len(prompts))]
        out: list[list[int]] = []
        try:
            for part in _fitting(list(prompts), max_new_tokens, engine.max_batch, engine.n_ctx):
                out += engine.generate(part, max_new_tokens, temperature, top_p, self.end_ids,
                                       own[len(out):len(out) + len(part)], weights)
        except Exception as exc:  # llama.cpp failing must not fail the run: torch draws
            reason = f"{type(exc).__name__}: {exc}"
            if reason not in self._said:
                self._said.add(reason)
                log.warning("llama.cpp cannot draw this run's samples (%s); torch draws them", reason)
            return None
        self.drawn += len(out)
        ends = set(self.end_ids)
        return [_before_end(row, ends) for row in out]

    def close(self) -> None:
        with self._lock:
            if self._engine is not None:
                self._engine.close()
            self._engine, self._asked = None, False


def _fitting(prompts: list[list[int]], max_new_tokens: int, max_batch: int, n_ctx: int) -> list[list[list[int]]]:
    """``prompts`` in order, in parts of at most ``max_batch`` whose prompts and answers fit ``n_ctx``
    tokens together (a prompt too long alone is a part of its own, which llama.cpp refuses)."""
    parts: list[list[list[int]]] = []
    part: list[list[int]] = []
    used = 0
    for p in prompts:
        need = len(p) + max_new_tokens
        if part and (len(part) == max_batch or used + need > n_ctx):
            parts.append(part)
            part, used = [], 0
        part.append(p)
        used += need
    if part:
        parts.append(part)
    return parts


def _before_end(row: list[int], ends: set[int]) -> list[int]:
    return next((row[:i] for i, t in enumerate(row) if t in ends), row)
