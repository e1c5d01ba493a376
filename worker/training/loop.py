"""The training run, written once: rated samples in, a LoRA adapter folder and metrics out.

:func:`run_training` is the skeleton every run goes through, whatever the backend (:mod:`.backend`)
and whatever the learning signal: check the input, let the signal pick the samples it trains on and
their advantages, encode them, seed, wrap the model with the parent's adapter (or a fresh one),
cross-validate a reward model of the user's ratings (:mod:`.reward_features`; its AUC is reported),
add the answers it explores with that model where it is good enough (:mod:`.exploration`) and the
hindsight teacher's rewrites it scores above the rated answers (:mod:`.rewrite`), let the
signal run its optimizer steps, save the adapter, measure and check the run, and return the
metrics every caller reads. A new learning signal implements :class:`Signal` and runs on every
backend that has the tensor operations it uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from rlfleet.shared import allocator
from rlfleet.shared.errors import RlfleetError

from ..batching import Encoded, encode_sample, ended_as_recorded
from ..objective import run_check
from ..presets import TrainConfig
from ..samples import Progress, RunResult, TrainSample, started_from
from . import exploration, feature_memo, reward_features, rewrite, scoring
from .backend import Backend

Report = Callable[[Progress], None]


class NothingToLearn(RlfleetError):
    """Every sample of a run has advantage 0: no update would move the model, so the run trains nothing
    and commits no version (one identical to its parent would be promoted and announced as new)."""


@dataclass(frozen=True)
class RunRequest:
    """What one run is handed: the rated samples (replayed earlier ones among them: they train, but
    their recorded log-probs are set aside), the reward baseline (None: the run's own mean), the
    settings, the adapter it continues (None: a fresh one), the folder it saves to, who hears of its
    progress, the prompts of recent answers nobody rated (exploration samples them too), and earlier
    ratings of the user that the reward model learns from beside the run's own (never trained on)."""

    samples: list[TrainSample]
    ema: float | None
    cfg: TrainConfig
    parent_adapter: Path | None
    out_dir: Path
    progress: Report | None = None
    captured: Sequence[list[dict]] = ()
    history: Sequence[TrainSample] = ()
    halfway_dir: Path | None = None  # where to save the adapter as it is after half the steps (None: not)


@dataclass(frozen=True)
class Selection:
    """What a signal trains on: the samples it keeps, in order, and the advantage of each."""

    samples: list[TrainSample]
    advantages: list[float]
    mean_advantage: float
    metrics: dict[str, float] = field(default_factory=dict)  # the signal's own, reported with the run's


@dataclass(frozen=True)
class RunData:
    """A run's input after selection and encoding."""

    given: list[TrainSample]  # every sample the run was handed
    samples: list[TrainSample]  # the ones trained on: selected ratings, then explored answers
    encoded: list[Encoded]
    advantages: list[float]
    parent_adapter: Path | None
    halfway_dir: Path | None = None  # the signal saves the adapter here after half its steps
    # The explored answers' prompt of each (they are the last len(explored_groups) samples), for
    # splitting them over the steps (train.explore_minibatches, exploration.minibatches).
    explored_groups: list[int] = field(default_factory=list)

    @property
    def n_response(self) -> int:
        return sum(e.n_response for e in self.encoded)

    @property
    def n_seen(self) -> int:
        """Tokens of all the run's samples: what one optimizer step runs the model over when every step
        trains on all of them (explored minibatches make a step see fewer: Outcome.tokens_seen)."""
        return sum(e.length for e in self.encoded)


@dataclass
class Outcome:
    """What a signal's optimizer steps report. A KL left at None is measured by the loop: the
    final one on the saved adapter, the mean one is then the final one; without a start KL the
    run's KL limit is not checked (only that the figures are finite)."""

    loss: float
    train_seconds: float
    accepted_token_frac: float
    accepted_seq_frac: float
    mean_kl: float | None = None
    start_kl: float | None = None
    final_kl: float | None = None
    extra: dict[str, float | int | str] = field(default_factory=dict)  # signal-specific metrics
    tokens_seen: int | None = None  # tokens all the steps ran the model over (None: each step ran over all)


class Signal(Protocol):
    """A learning signal: which samples train with which advantage, and how the weights move."""

    def select(self, backend: Backend, samples: list[TrainSample], ema: float | None, cfg: TrainConfig) -> Selection:
        ...

    def train(
        self, backend: Backend, session: Any, data: RunData, cfg: TrainConfig, report: Report
    ) -> AbstractContextManager[Outcome]:
        """Run ``cfg.steps`` optimizer steps inside the adapter session (``session`` is what the
        backend's ``adapter`` yielded); the context stays open while the loop saves the adapter.
        With ``data.halfway_dir`` set, also save the adapter there as it is after
        :func:`halfway_steps` updates (a signal that cannot leaves it empty: there is then nothing to
        fall back on)."""


def run_training(backend: Backend, signal: Signal, run: RunRequest) -> RunResult:
    """Train ``run.cfg.steps`` optimizer steps over ``run.samples``; save the adapter to ``run.out_dir``."""
    cfg = run.cfg
    if not run.samples:
        raise ValueError("a training run needs at least one sample")
    # A rated answer the length cap cut off trains without an end token, as an explored one does: one
    # the user liked would otherwise teach the model to stop mid-sentence where the cap fell.
    samples = [ended_as_recorded(s, backend.tokenizer) for s in run.samples]
    started = time.perf_counter()
    report = run.progress or (lambda _p: None)
    out_dir = Path(run.out_dir)

    chosen = signal.select(backend, samples, run.ema, cfg)
    start = started_from(run.parent_adapter)
    encoded = [encode_sample(backend.tokenizer, _on_start_policy(s, start), cfg.max_tokens) for s in chosen.samples]
    backend.seed(cfg.seed)  # the LoRA's initial weights (and anything else random) repeat per seed
    with backend.adapter(run.parent_adapter, cfg, trainable=True, precision=cfg.precision) as session:
        precision = backend.precision
        if cfg.explore > 0:  # the reward model is fitted and answers sampled before the reference pass
            report(Progress(0, cfg.steps, 0.0, phase="exploring"))
        # Before the first update: the reward model sees the answers as the run's starting policy
        # does, and explored answers are sampled from that policy (their behaviour policy).
        # What the worker pooled and drew under that policy while it waited is read, not done again.
        memo = feature_memo.memo_for(backend, run.parent_adapter, precision)
        reward_model = reward_features.measure(backend, reward_features.with_history(samples, run.history),
                                               cfg.max_tokens, cfg.seed, memo.pooled)
        explored = exploration.explore(backend, samples, reward_model, cfg, run.captured, memo)
        # The teacher's rewrites train beside the ratings, in every step; the explored answers last.
        rewrites = rewrite.rewrite(backend, samples, reward_model, cfg)
        added = rewrites.samples + explored.samples
        encoded += [encode_sample(backend.tokenizer, s, cfg.max_tokens) for s in added]
        data = RunData(samples, chosen.samples + added, encoded,
                       chosen.advantages + rewrites.advantages + explored.advantages,
                       run.parent_adapter, run.halfway_dir, explored.groups)
        if not any(data.advantages):
            raise NothingToLearn(nothing_to_learn(chosen.samples))
        with signal.train(backend, session, data, cfg, report) as outcome:
            report(Progress(cfg.steps, cfg.steps, 0.0, outcome.loss, phase="saving"))
            backend.save(out_dir)
    final_kl = outcome.final_kl
    if final_kl is None:
        final_kl = scoring.saved_adapter_kl(backend, data.samples, out_dir, cfg.max_tokens)

    n_retractions = sum(s.fixed_advantage is not None for s in samples)
    n_replayed = sum(s.replayed for s in samples)
    metrics: dict[str, float | int | str | None] = {
        "ratings_used": len(samples) - n_retractions - n_replayed,
        "retractions": n_retractions,
        "replayed": n_replayed,
        "mean_advantage": chosen.mean_advantage,
        "loss": outcome.loss,
        "mean_kl": final_kl if outcome.mean_kl is None else outcome.mean_kl,
        "final_mean_kl": final_kl,
        "accepted_token_frac": outcome.accepted_token_frac,
        "accepted_seq_frac": outcome.accepted_seq_frac,
        "tokens_per_s": (data.n_seen * cfg.steps if outcome.tokens_seen is None else outcome.tokens_seen)
        / max(outcome.train_seconds, 1e-9),
        "seconds": time.perf_counter() - started,
        "steps": cfg.steps,
        "lr": cfg.lr,
        "precision": precision,
        "allocator": allocator.in_use(),  # (the process's malloc: rlfleet.shared.allocator)
        "n_tokens": data.n_response,
        "ratings_cut": sum(not s.complete for s in samples),
        **chosen.metrics,
        **reward_model.metrics(),
        **explored.metrics(),
        **rewrites.metrics(),
        **outcome.extra,
    }
    start_kl = final_kl if outcome.start_kl is None else outcome.start_kl
    ok, reason = run_check(outcome.loss, start_kl, final_kl, cfg.max_mean_kl)
    return RunResult(
        metrics=metrics,
        advantages={s.rating_id: a for s, a in zip(chosen.samples, chosen.advantages, strict=True)
                    if s.rating_id is not None},
        promoted_ok=ok,
        reason=reason,
    )


def halfway_steps(steps: int) -> int:
    """After how many of a run's ``steps`` updates its halfway adapter is saved (0: a run too short
    to have one)."""
    return steps // 2 if steps >= 2 else 0


def nothing_to_learn(samples: list[TrainSample]) -> str:
    """Why a run whose advantages are all 0 trains nothing, in the user's terms."""
    liked = sum(s.reward > 0 for s in samples)
    why = ("none of them liked: the asymmetric advantage (train.advantage) teaches through the answers "
           "a user liked, and a 👍 on one is what moves the model" if liked == 0 else
           "every advantage is 0")
    return f"nothing to learn from these {len(samples)} ratings yet, {why}"


def _on_start_policy(sample: TrainSample, start: str) -> TrainSample:
    """``sample`` without its recorded log-probs where the run-start policy (version ``start``) stands in
    for its behaviour policy:

    * a replayed sample: an older version answered it, so they describe neither the policy the run
      starts from nor one near it, and the objective's bands would drop it or blow up its ratios;
    * an answer the run's own starting version drew: the run-start pass *is* its behaviour, exactly and
      in the run's own numerics, where the recorded values may be llama.cpp's (quantised weights,
      hundredths of a nat off per token: ratios that are not 1 before any update, and now and then a
      token outside its band).

    (docs/objective.md, "Behaviour")"""
    if not sample.replayed and sample.answered_by != start:  # (None, not known, is never a version)
        return sample
    return replace(sample, behaviour_logprobs=None, behaviour_token_ids=None)
