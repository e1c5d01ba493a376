"""The trainer interface the worker, the gate and the benchmarks call, mixed into each backend class:
a run with the worker's learning signal, and the measurements of :mod:`.scoring`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..gate import GateConfig, ModelScores
from ..presets import TrainConfig
from ..samples import RunResult, TrainSample
from . import scoring
from .backend import Backend
from .loop import Report, RunRequest, run_training
from .policy_gradient import PolicyGradient

Pairs = Sequence[tuple[list[dict], str]]
T = TypeVar("T")
R = TypeVar("R")


class TrainerInterface:
    def parallel_batches(self, workers: int | None) -> None:
        """How many micro-batches a pass may run at once (``train.parallel_batches``); a backend that
        runs one at a time ignores it."""

    def each(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``[fn(x) for x in items]``: one pass's work per micro-batch, which a backend may run several
        of at once (the results in ``items``' order, gradients accumulated in that order)."""
        return [fn(x) for x in items]

    def draw_with(self, engine: str, load: bool = False) -> None:
        """What draws the answers a run samples (``chat.engine``; ``load``: load it now, not at the first
        draw); a backend without llama.cpp draws them itself whatever it is told."""

    def run(
        self: Backend,
        samples: list[TrainSample],
        ema: float | None,
        cfg: TrainConfig,
        parent_adapter: Path | None,
        out_dir: Path,
        progress: Report | None = None,
        captured: Sequence[list[dict]] = (),
        history: Sequence[TrainSample] = (),
        halfway_dir: Path | None = None,
    ) -> RunResult:
        """One run of the worker's learning signal; see :func:`.loop.run_training`."""
        run = RunRequest(samples, ema, cfg, parent_adapter, out_dir, progress, captured, history, halfway_dir)
        return run_training(self, PolicyGradient(), run)

    def token_logprobs(
        self: Backend, pairs: Pairs, adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[list[float]]:
        return scoring.token_logprobs(self, pairs, adapter_dir, max_tokens)

    def mean_logprobs(
        self: Backend, pairs: Pairs, adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[float]:
        return scoring.mean_logprobs(self, pairs, adapter_dir, max_tokens)

    def sequence_logprobs(self: Backend, prompt: list[dict], response: str, adapter_dir: Path | None) -> float:
        """Mean per-token log-prob of ``response`` after ``prompt``; see :func:`scoring.mean_logprobs`."""
        return scoring.mean_logprobs(self, [(prompt, response)], adapter_dir)[0]

    def score_model(
        self: Backend, pairs: Pairs, adapter_dir: Path | None, cfg: GateConfig, max_tokens: int = 1024, seed: int = 0
    ) -> ModelScores:
        return scoring.score_model(self, pairs, adapter_dir, cfg, max_tokens, seed)
