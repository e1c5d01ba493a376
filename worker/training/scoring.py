"""Measurements on a model (the base, or the base plus an adapter folder), written once over a backend.

- :func:`token_logprobs` / :func:`mean_logprobs`: teacher-forced log-probs of answers, with the same
  encoding and computation as training (so usable as recorded behaviour log-probs).
- :func:`score_model`: the evaluation gate's measurement on held-out rated answers: the mean
  log-prob of each, the exact KL to the base and the next-token entropy at each answer position,
  and sampled answers on the held-out prompts (distinct bigrams, repetition and length: the
  signals a teacher-forced pass cannot see). The base's sampled answers depend on nothing but the
  base and the prompts: :func:`draw_held` remembers them per prompt (each answer seeded by the prompt
  and its occurrence), so the training worker draws them while it waits (worker/idle_work.py) and
  a later gate on the same prompt reads them. :func:`score_beside_base` reads the base's log-probs
  and entropy from the pass of the base a candidate's exact KL runs anyway.
- :func:`held_hints` / :func:`teacher_divergences`: held-out answers that came with words, as the
  hindsight teacher reads them, and how far a model's next-token distributions on them are from the
  teacher's: the gate's second side when the held-out ratings are all of one class.
- :func:`saved_adapter_kl`: the per-token KL of a saved adapter to the base on a run's samples.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..batching import Encoded, encode_sample
from ..gate import GateConfig, ModelScores, sample_plan
from ..samples import TrainSample
from .backend import Backend, TokenSums, TopRow
from .feature_memo import DrawKey, Draws, prompt_seed
from .hindsight import hint_for, hinted, rows_of

Pairs = Sequence[tuple[list[dict], str]]
EVAL_BATCH_TOKENS = 4096  # micro-batch budget of the measurements (no gradient: larger than training's)
GATE_SEED = 0  # what the gate's sampled answers are seeded from (the worker draws the base's ahead with it)


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
    seed: int = GATE_SEED,
    drawn: Draws | None = None,
    with_kl: bool = True,
) -> ModelScores:
    """The gate's measurement of the base, or the base plus ``adapter_dir``, on ``pairs``: per
    answer the token log-prob, entropy and KL-to-base sums, and ``cfg.eval_samples`` sampled
    answers (at the chat's temperature and top-p) of at most ``cfg.eval_new_tokens`` tokens;
    ``drawn``: where the model's answers per prompt are remembered (:func:`draw_held`; None: drawn
    anew in one batch). ``with_kl`` False: the KL sums are 0 (no pass of the base beside the adapter's,
    for a model whose margin alone is read)."""
    return _scored(backend, pairs, adapter_dir, cfg, max_tokens, seed, drawn, with_kl)[0]


def score_beside_base(backend: Backend, pairs: Pairs, adapter_dir: Path, cfg: GateConfig, max_tokens: int,
                      base_sampled: Sequence[Sequence[int]]) -> tuple[ModelScores, ModelScores]:
    """:func:`score_model` of the base plus ``adapter_dir``, and the base's log-prob and entropy sums
    from the pass of the base its exact KL runs anyway (same session, same numerics as the
    adapter's), with ``base_sampled``, the base's sampled answers (:func:`sample_answers` of the
    base): the base measured without a pass of its own."""
    model, base = _scored(backend, pairs, adapter_dir, cfg, max_tokens, GATE_SEED, None, True)
    assert base is not None  # a KL pass runs the base
    sampled = list(base_sampled)
    return model, ModelScores.from_sums(base.logprob, base.entropy, base.kl, base.tokens, sampled)


class _Sums:
    """Per answer sums over a pass, in the pairs' order."""

    def __init__(self, n: int) -> None:
        self.logprob, self.entropy, self.kl, self.tokens = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n

    def put(self, i: int, row: TokenSums) -> None:
        self.logprob[i], self.entropy[i], self.kl[i], self.tokens[i] = row


def _scored(backend: Backend, pairs: Pairs, adapter_dir: Path | None, cfg: GateConfig, max_tokens: int,
            seed: int, drawn: Draws | None, with_kl: bool) -> tuple[ModelScores, _Sums | None]:
    """The model's scores and, where its KL pass ran the base beside it, the base's sums."""
    groups, batches = _batches(backend, pairs, max_tokens)
    with_kl = with_kl and adapter_dir is not None
    model, base = _Sums(len(pairs)), _Sums(len(pairs)) if with_kl else None
    with _serving(backend, adapter_dir):
        for g, batch in zip(groups, batches, strict=True):
            for i, row in zip(g, backend.score_rows(batch, with_kl=with_kl), strict=True):
                model.put(i, row.model)
                if base is not None and row.base is not None:
                    base.put(i, row.base)
        sampled = sample_answers(backend, [p for p, _r in pairs], cfg, seed, drawn)
    return ModelScores.from_sums(model.logprob, model.entropy, model.kl, model.tokens, sampled), base


def sample_answers(backend: Backend, prompts: Sequence[list[dict]], cfg: GateConfig, seed: int,
                   drawn: Draws | None = None) -> list[list[int]]:
    """The answers the gate's collapse checks read from the model being served: ``cfg.eval_samples``
    of them cycling through ``prompts``, at the chat's temperature and top-p, in one batch, with the
    same seeds for every model judged (the base's and the candidate's answers differ by the models
    alone). Where the backend seeds each row (:attr:`Backend.rows_seeded`) the i-th answer to a prompt
    is seeded by the prompt and i, and with ``drawn`` those it remembers (:func:`draw_held`) are read
    and only the rest drawn; elsewhere one stream per batch from ``seed``, nothing remembered."""
    plan = sample_plan(list(prompts), cfg.eval_samples)
    if not plan:
        return []
    if not backend.rows_seeded:
        return backend.sample(plan, cfg.eval_new_tokens, seed, cfg.eval_temperature, cfg.eval_top_p)
    drawn = {} if drawn is None else drawn
    keys = [held_draw_key(p, cfg, seed) for p in plan]
    wanted = Counter(keys)
    first = {key: p for key, p in zip(keys, plan, strict=True)}
    draw_held(backend, [(first[key], n) for key, n in wanted.items()], cfg, seed, drawn)
    nth: Counter[DrawKey] = Counter()
    out = []
    for key in keys:
        out.append(drawn[key][nth[key]])
        nth[key] += 1
    return out


def held_known(backend: Backend, prompts: Sequence[list[dict]], cfg: GateConfig, seed: int, drawn: Draws) -> int:
    """How many of the answers :func:`sample_answers` asks for on ``prompts`` ``drawn`` holds already."""
    if not backend.rows_seeded:
        return 0
    wanted = Counter(held_draw_key(p, cfg, seed) for p in sample_plan(list(prompts), cfg.eval_samples))
    return sum(min(n, len(drawn.get(key, ()))) for key, n in wanted.items())


def held_draw_key(prompt: list[dict], cfg: GateConfig, seed: int) -> DrawKey:
    """What the gate's answers to a held-out prompt are remembered under (beside the model that drew
    them)."""
    return ("held", json.dumps(prompt, sort_keys=True), cfg.eval_new_tokens, cfg.eval_temperature, cfg.eval_top_p,
            seed)


def draw_held(backend: Backend, wanted: Sequence[tuple[list[dict], int]], cfg: GateConfig, seed: int,
              drawn: Draws, stop: Callable[[], bool] = lambda: False) -> int:
    """Make ``drawn`` hold at least ``n`` of the gate's answers to each ``(prompt, n)`` of ``wanted``
    from the active model: the missing ones drawn in one batch, the i-th answer to a prompt seeded
    by the prompt and i, so that it is the same answer whichever batch drew it (where the kernels seed
    a row of its own: :attr:`Backend.rows_seeded`; elsewhere nothing is drawn ahead). Nothing is drawn
    when ``stop()`` says to let go; returns how many answers it drew."""
    rows: list[list[dict]] = []
    seeds: list[int] = []
    owners: list[DrawKey] = []
    for prompt, n in wanted:
        key = held_draw_key(prompt, cfg, seed)
        for i in range(len(drawn.get(key, ())), n):
            rows.append(prompt)
            seeds.append(prompt_seed(prompt, seed, i))
            owners.append(key)
    if not rows or stop() or not backend.rows_seeded:
        return 0
    answers = backend.sample(rows, cfg.eval_new_tokens, seed, cfg.eval_temperature, cfg.eval_top_p, seeds)
    for key, ids in zip(owners, answers, strict=True):
        drawn.setdefault(key, []).append(ids)
    return len(rows)


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
