"""Measurements on a model (the base, or the base plus an adapter folder), written once over a backend.

- :func:`token_logprobs` / :func:`mean_logprobs`: teacher-forced log-probs of answers, with the same
  encoding and computation as training (so usable as recorded behaviour log-probs).
- :func:`score_model`: the evaluation gate's measurement on held-out rated answers: the mean
  log-prob of each, the exact KL to the base and the next-token entropy at each answer position,
  and sampled answers on the held-out prompts (distinct bigrams, repetition and length: the
  signals a teacher-forced pass cannot see).
- :func:`held_hints` / :func:`teacher_divergences`: held-out answers that came with words, as the
  hindsight teacher reads them, and how far a model's next-token distributions on them are from the
  teacher's: the gate's second side when the held-out ratings are all of one class.
- :func:`saved_adapter_kl`: the per-token KL of a saved adapter to the base on a run's samples.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..batching import Encoded, encode_sample
from ..gate import GateConfig, ModelScores, sample_plan
from ..samples import TrainSample
from .backend import Backend, TopRow
from .hindsight import hint_for, hinted, rows_of

Pairs = Sequence[tuple[list[dict], str]]
EVAL_BATCH_TOKENS = 4096  # micro-batch budget of the measurements (no gradient: larger than training's)


@contextlib.contextmanager
def _serving(backend: Backend, adapter_dir: Path | None) -> Iterator[None]:
    """The base, or the base with the adapter in ``adapter_dir``, for the block."""
    if adapter_dir is None:
        yield
        return
    with backend.adapter(Path(adapter_dir), None):
        yield


def _batches(backend: Backend, pairs: Pairs, max_tokens: int) -> tuple[list[list[int]], list]:
    samples = [TrainSample(rating_id=i, prompt=p, response=r, reward=0.0) for i, (p, r) in enumerate(pairs)]
    encoded = [encode_sample(backend.tokenizer, s, max_tokens) for s in samples]
    return backend.batches(encoded, EVAL_BATCH_TOKENS)


def token_logprobs(
    backend: Backend, pairs: Pairs, adapter_dir: Path | None = None, max_tokens: int = 1024
) -> list[list[float]]:
    """Per-token log-probs of each ``(prompt, response)`` pair's response tokens (end token
    included) under the base, or the base plus the adapter in ``adapter_dir``; fp32."""
    groups, batches = _batches(backend, pairs, max_tokens)
    result: list[list[float]] = [[] for _ in pairs]
    with _serving(backend, adapter_dir):
        for g, batch in zip(groups, batches, strict=True):
            for i, values in zip(g, backend.response_logprobs(batch), strict=True):
                result[i] = values
    return result


def mean_logprobs(
    backend: Backend, pairs: Pairs, adapter_dir: Path | None = None, max_tokens: int = 1024
) -> list[float]:
    """Mean per-token log-prob of each pair's response; see :func:`token_logprobs`."""
    return [sum(v) / max(len(v), 1) for v in token_logprobs(backend, pairs, adapter_dir, max_tokens)]


def score_model(
    backend: Backend,
    pairs: Pairs,
    adapter_dir: Path | None,
    cfg: GateConfig,
    max_tokens: int = 1024,
    seed: int = 0,
) -> ModelScores:
    """The gate's measurement of the base, or the base plus ``adapter_dir``, on ``pairs``: per
    answer the token log-prob, entropy and KL-to-base sums, and ``cfg.eval_samples`` sampled
    answers (at the chat's temperature and top-p) of at most ``cfg.eval_new_tokens`` tokens."""
    groups, batches = _batches(backend, pairs, max_tokens)
    n = len(pairs)
    lp_sum, ent_sum, kl_sum, count = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
    with _serving(backend, adapter_dir):
        for g, batch in zip(groups, batches, strict=True):
            for i, row in zip(g, backend.score_rows(batch, with_kl=adapter_dir is not None), strict=True):
                lp_sum[i], ent_sum[i], kl_sum[i], count[i] = row
        sampled = sample_answers(backend, [p for p, _r in pairs], cfg, seed)
    return ModelScores.from_sums(lp_sum, ent_sum, kl_sum, count, sampled)


def sample_answers(backend: Backend, prompts: Sequence[list[dict]], cfg: GateConfig, seed: int) -> list[list[int]]:
    """The answers the gate's collapse checks read from the model being served: ``cfg.eval_samples``
    of them cycling through ``prompts``, at the chat's temperature and top-p, in one batch."""
    plan = sample_plan(list(prompts), cfg.eval_samples)
    return backend.sample(plan, cfg.eval_new_tokens, seed, cfg.eval_temperature, cfg.eval_top_p) if plan else []


@dataclass(frozen=True)
class HeldHints:
    """Held-out rated answers that came with words: each as the model reads it (no hint), and the
    teacher's K likeliest next tokens at each of its positions with the words in its context."""

    encoded: list[Encoded]
    teacher: list[TopRow]


@contextlib.contextmanager
def _teaching(backend: Backend, spec: str | None) -> Iterator[None]:
    """The hindsight teacher for the block, outside a training session: the base (no adapter is
    loaded between runs), or the model ``spec`` names."""
    if spec is None:
        yield
        return
    with backend.teacher(spec):
        yield


def held_hints(backend: Backend, held: Sequence[TrainSample], spec: str | None, top_k: int,
               max_tokens: int = 1024) -> HeldHints | None:
    """The held-out answers whose ratings came with words, scored by the teacher reading them (the base
    with the words in its context, as :mod:`.hindsight` teaches, or ``spec``); None when none did."""
    hints = {i: h for i, s in enumerate(held) if (h := hint_for(s)) is not None}
    if not hints:
        return None
    encoded = [encode_sample(backend.tokenizer, s, max_tokens) for s in held]
    taught = hinted(backend, held, encoded, hints, max_tokens)
    if not taught:
        return None
    index = sorted(taught)
    with _teaching(backend, spec):
        rows = rows_of(backend, [taught[i] for i in index], EVAL_BATCH_TOKENS,
                       lambda b: backend.response_top(b, top_k))
    return HeldHints([encoded[i] for i in index], rows)


def teacher_divergences(backend: Backend, hints: HeldHints, adapter_dir: Path | None) -> list[float]:
    """Per hinted answer, the mean per-token divergence of the base (or the base plus the adapter in
    ``adapter_dir``) from the teacher: :func:`rlfleet.worker.objective.hindsight_kl`, the very term the
    hindsight pull minimises on the answers a run trains on."""
    groups, batches = backend.batches(hints.encoded, EVAL_BATCH_TOKENS)
    out = [0.0] * len(hints.encoded)
    with _serving(backend, adapter_dir):
        for g, batch in zip(groups, batches, strict=True):
            targets = backend.teacher_targets(batch, [(hints.teacher[i], 1.0) for i in g])
            for i, (total, n) in zip(g, backend.teacher_divergence(batch, targets), strict=True):
                out[i] = total / max(n, 1)
    return out


def saved_adapter_kl(backend: Backend, samples: Sequence[TrainSample], adapter_dir: Path, max_tokens: int) -> float:
    """Mean per-token KL (k3 estimator) of the adapter in ``adapter_dir`` to the base, over the
    response tokens of ``samples``: the figure a run reports as its final KL."""
    pairs = [(s.prompt, s.response) for s in samples]
    ref = token_logprobs(backend, pairs, None, max_tokens)
    new = token_logprobs(backend, pairs, adapter_dir, max_tokens)
    total = count = 0.0
    for new_seq, ref_seq in zip(new, ref, strict=True):
        for new_lp, ref_lp in zip(new_seq, ref_seq, strict=True):
            d = ref_lp - new_lp
            total += math.exp(d) - d - 1.0
            count += 1
    return total / max(count, 1)
