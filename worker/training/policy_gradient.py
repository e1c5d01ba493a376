"""The worker's learning signal: single-rollout policy gradient on rated answers.

Every sample trains, with the advantage of :mod:`.advantages`. Before the first update the run
computes, once per micro-batch, the reference log-probs (the base: the KL anchor) and the behaviour
log-probs (the recorded ones where a sample brings them, the policy at the start of the run
elsewhere); each optimizer step then accumulates the objective (``cfg.objective``, see
:mod:`rlfleet.worker.objective`) over the ratings' micro-batches and, where the run explored, one
minibatch of the explored answers' in turn (:func:`step_plan`, ``train.explore_minibatches``).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..presets import TrainConfig
from ..samples import Progress, TrainSample
from .advantages import balance_classes, run_advantages
from .backend import Backend, Batch, FromStep, RefExtras, Tensor
from .exploration import minibatches
from .hindsight import teach
from .loop import Outcome, Report, RunData, Selection, halfway_steps
from .loops import CHECK_EVERY, LoopBatch, LoopPool, batched, check


class PolicyGradient:
    def select(self, backend: Backend, samples: list[TrainSample], ema: float | None, cfg: TrainConfig) -> Selection:
        adv = run_advantages(samples, ema, cfg.pos_weight, cfg.adv_clip, rule=cfg.advantage, delta=cfg.adv_delta,
                             neg_bound=cfg.neg_bound)
        adv, weight = balance_classes(adv, [s.fixed_advantage is None for s in samples], cfg.balance)
        metrics = {"class_weight": weight} if cfg.balance > 0 else {}
        return Selection(list(samples), adv, sum(adv) / len(adv), metrics)

    @contextlib.contextmanager
    def train(
        self, backend: Backend, session: Any, data: RunData, cfg: TrainConfig, report: Report
    ) -> Iterator[Outcome]:
        backend.begin_training(cfg)
        parts, weights = step_plan(len(data.samples), data.explored_groups, cfg.explore_minibatches)
        groups: list[list[int]] = []
        batches: list[Batch] = []
        part_of: list[int] = []  # each micro-batch's part (0: the ratings)
        for p, members in enumerate(parts):
            g, b = backend.batches([data.encoded[i] for i in members], cfg.micro_batch_tokens)
            groups += [[members[j] for j in grp] for grp in g]
            batches += b
            part_of += [p] * len(g)
        report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0, phase="reference"))
        first = step_trains(0, part_of, len(parts))
        ref, extras, beh = _fixed_logprobs(backend, data, groups, batches, cfg.kl_top_k,
                                           cfg.entropy_hinge > 0, first)
        lesson = teach(backend, data.samples, data.encoded, groups, batches, cfg)
        extras = [x if t is None else replace(x or RefExtras(), teacher=t)
                  for x, t in zip(extras, lesson.targets, strict=True)]
        report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0))  # the optimizer steps begin

        advantages = [backend.vector([data.advantages[i] for i in g]) for g in groups]
        # Each micro-batch's loss is a mean over its sequences: weighting it by its sequences' weights
        # makes the accumulated gradient the step's estimate of the mean over the whole run.
        shares = [sum(weights[i] for i in g) for g in groups]
        n_response = [sum(data.encoded[i].n_response for i in g) for g in groups]
        n_seen = [sum(data.encoded[i].length for i in g) for g in groups]
        token_fracs: list[float] = []
        seq_fracs: list[float] = []
        loss_value = mean_kl = start_kl = float("nan")
        # The run's check compares the KL to the base where the run ends with where it starts, both over
        # the rated answers (the ratings' micro-batches, which every step trains): the start is the first
        # step's own pass, before its update, and the end one pass after the last update over those
        # alone, not over the explored answers too, which are most of a run's tokens.
        checked = [k for k in first if part_of[k] == 0] or first
        start_sums: list[tuple[float, int]] = []  # (KL sum, response tokens) per checked micro-batch
        anchor_kls: list[float] = []  # per step: the top-k anchor's mean KL per response token
        excesses: list[float] = []  # per step: the entropy hinge's mean rise over the base's entropy
        distills: list[float] = []  # per step: the hindsight term, a mean over the step's samples
        loops = LoopPool()  # the policy's own looping answers (train.unlikelihood)
        loop_batches: list[LoopBatch] = []
        seen = 0
        train_started = time.perf_counter()
        for step in range(cfg.steps):
            if cfg.unlikelihood > 0 and step > 0 and step % CHECK_EVERY == 0:
                caught = len(loops.encoded)
                check(backend, loops, data.samples, step, cfg.seed)
                if len(loops.encoded) > caught:
                    loop_batches = batched(backend, loops, cfg.micro_batch_tokens)
            backend.begin_step()
            active = step_trains(step, part_of, len(parts))
            step_loss = kl_sum = anchor_sum = excess_sum = distill_sum = tok_acc = seq_acc = 0.0
            # The caught loops' micro-batches run beside the step's own (their gradients are added after
            # theirs, in order, as one after the other would).
            jobs: list[Callable[[], Any]] = [
                functools.partial(backend.accumulate, batches[k], beh[k], ref[k], advantages[k], shares[k],
                                  extras=extras[k]) for k in active]
            jobs += [functools.partial(backend.accumulate_unlikelihood, batch, marks, cfg.unlikelihood, share)
                     for batch, marks, share in loop_batches]
            step_stats = backend.each(lambda job: job(), jobs)[:len(active)]
            for k, stats in zip(active, step_stats, strict=True):
                if stats.fixed is not None:  # the first step's pass gave them: they hold from now on
                    beh[k], ref[k] = stats.fixed
                if step == 0 and k in checked:
                    start_sums.append((stats.mean_kl * stats.n_tokens, stats.n_tokens))
                step_loss += stats.loss * shares[k]
                kl_sum += stats.mean_kl * stats.n_tokens
                anchor_sum += (stats.anchor_kl or 0.0) * stats.n_tokens
                excess_sum += (stats.entropy_excess or 0.0) * stats.n_tokens
                distill_sum += (stats.hindsight_kl or 0.0) * shares[k]
                tok_acc += stats.accepted_tokens
                seq_acc += stats.accepted_seqs
            # With every sequence filtered out the gradient is KL-only; AdamW's momentum and decay
            # would still move the weights, defeating the filter as a trust region.
            backend.finish_step(apply=seq_acc > 0)
            if data.halfway_dir is not None and step + 1 == halfway_steps(cfg.steps):
                backend.save(data.halfway_dir)
            step_response = max(sum(n_response[k] for k in active), 1)
            loss_value, mean_kl = step_loss, kl_sum / step_response
            if step == 0:  # measured before the first update: where the run starts
                start_kl = sum(kl for kl, _ in start_sums) / max(sum(n for _, n in start_sums), 1)
            anchor_kls.append(anchor_sum / step_response)
            excesses.append(excess_sum / step_response)
            distills.append(distill_sum / max(sum(shares[k] for k in active), 1e-12))
            token_fracs.append(tok_acc / step_response)
            seq_fracs.append(seq_acc / max(sum(len(groups[k]) for k in active), 1))
            seen += sum(n_seen[k] for k in active)
            elapsed = time.perf_counter() - train_started
            report(Progress(step + 1, cfg.steps, seen / max(elapsed, 1e-9), loss_value))
        train_seconds = time.perf_counter() - train_started
        # of what is saved (the last step's predates its update), over the start's micro-batches
        final_kl = _mean_kl(backend, [batches[k] for k in checked], [ref[k] for k in checked])
        final_kl_seconds = time.perf_counter() - train_started - train_seconds

        yield Outcome(
            loss=loss_value,
            train_seconds=train_seconds,
            accepted_token_frac=_mean(token_fracs),
            accepted_seq_frac=_mean(seq_fracs),
            mean_kl=mean_kl,
            start_kl=start_kl,
            final_kl=final_kl,
            tokens_seen=seen,
            # The anchor's KL and the entropy's rise over the base's, before the first update and at
            # the last step (before its update).
            extra={
                "final_kl_seconds": final_kl_seconds,
                **({"anchor_kl_start": anchor_kls[0], "anchor_kl": anchor_kls[-1]} if cfg.kl_top_k else {}),
                **({"entropy_excess_start": excesses[0], "entropy_excess": excesses[-1]}
                   if cfg.entropy_hinge > 0 else {}),
                **(loops.metrics() if cfg.unlikelihood > 0 else {}),
                **{k: v for k, v in lesson.metrics.items() if v is not None},
                **({"hindsight_kl_start": distills[0], "hindsight_kl": distills[-1]}
                   if lesson.metrics.get("hint_taught") else {}),
            },
        )


def step_plan(n_samples: int, explored_groups: Sequence[int], n: int) -> tuple[list[list[int]], list[float]]:
    """A run's ``n_samples`` samples (the last ``len(explored_groups)`` explored, ``explored_groups[i]``
    the prompt of the i-th) as parts, and each sample's weight in a step's mean.

    Part 0 is the ratings, trained in every step; the others are the explored answers'
    :func:`.exploration.minibatches` (up to ``n``), one per step in turn (:func:`step_part`). A rating
    weighs 1/N and an explored answer E/(m·N), in a minibatch of m of the E explored answers: each
    step's gradient is, in expectation over the minibatches, the mean over all N samples, as it is
    exactly with one minibatch."""
    n_rated = n_samples - len(explored_groups)
    explored = [[n_rated + i for i in mb] for mb in minibatches(explored_groups, n)]
    weights = [1.0 / n_samples] * n_samples
    for mb in explored:
        for i in mb:
            weights[i] = len(explored_groups) / (len(mb) * n_samples)
    return [list(range(n_rated)), *explored], weights


def step_part(step: int, n_parts: int) -> int:
    """The explored part that trains in optimizer step ``step`` (0-based) of a run with ``n_parts``
    parts (:func:`step_plan`); 0, the ratings alone, when nothing was explored."""
    return 1 + step % (n_parts - 1) if n_parts > 1 else 0


def step_trains(step: int, part_of: Sequence[int], n_parts: int) -> list[int]:
    """The micro-batches (``part_of[k]``: micro-batch k's part) optimizer step ``step`` trains: the
    ratings' and its explored part's (:func:`step_part`)."""
    explored = step_part(step, n_parts)
    return [k for k, part in enumerate(part_of) if part in (0, explored)]


def _fixed_logprobs(
    backend: Backend, data: RunData, groups: list[list[int]], batches: list[Batch], top_k: int = 0,
    entropy: bool = False, first: Sequence[int] = (),
) -> tuple[list[Tensor | None], list[RefExtras | None], list[Tensor | FromStep]]:
    """Per micro-batch: reference log-probs (adapter off), what the reference pass keeps beside them
    (the base's ``top_k`` likeliest next tokens, with ``entropy`` its next-token entropy; None each
    without either) and behaviour log-probs.

    Behaviour = the recorded log-probs where encode_sample kept them (never a replayed sample's: the
    loop sets those aside), the policy at the start of the run elsewhere. A fresh LoRA starts exactly
    at the base (B = 0), so then the reference pass doubles as the behaviour pass.

    The micro-batches the first optimizer step trains (``first``) get no pass of their own where the
    backend lets that step's forward stand in (:class:`.backend.FromStep`, whose reference is None
    here with a fresh LoRA): before its update the step's pass is the run-start pass, batch for batch.
    Not with the top-k anchor or the entropy hinge, which read the base's whole distribution.

    Recorded log-probs are fp32 values (the responder's). In a bf16 session the policy's log-probs
    differ from fp32 ones by rounding alone, enough to move a sequence's ratio by tenths of a percent
    before any update, so each recorded value is moved by that rounding difference, measured at the
    run-start policy (its bf16 log-prob minus its fp32 one): a sample the run-start policy answered
    then has a ratio of exactly 1 at the start, as in fp32 (:mod:`.precision`).
    """
    encoded = data.encoded
    fresh = data.parent_adapter is None
    # In bf16 the rounding shift below is measured on the run-start policy itself, so with a parent
    # adapter its pass is needed even when every sample brings recorded log-probs.
    need_start = not fresh and (backend.precision != "fp32" or any(
        e.behaviour_logprobs is None or len(e.behaviour_logprobs) < e.n_response for e in encoded
    ))
    stand_in = set(first) if backend.step_stands_in and not (top_k or entropy) and (fresh or need_start) else set()
    ref: list[Tensor | None] = [None] * len(batches)
    extras: list[RefExtras | None] = [None] * len(batches)
    ref_rows = [k for k in range(len(batches)) if not (fresh and k in stand_in)]
    with backend.reference():
        if top_k or entropy:
            pairs = backend.each(lambda k: backend.reference_logprobs(batches[k], top_k, entropy), ref_rows)
            for k, (lp, x) in zip(ref_rows, pairs, strict=True):
                ref[k], extras[k] = lp, x
        else:
            for k, lp in zip(ref_rows, backend.each(lambda k: backend.logprobs(batches[k]), ref_rows), strict=True):
                ref[k] = lp
    start_rows = [k for k in range(len(batches)) if k not in stand_in] if need_start else []
    start = dict(zip(start_rows, backend.each(lambda k: backend.logprobs(batches[k]), start_rows), strict=True))
    recorded = [[(row, encoded[i].prompt_len, encoded[i].behaviour_logprobs or [])
                 for row, i in enumerate(g) if encoded[i].behaviour_logprobs] for g in groups]
    shifted = [k for k, rows in enumerate(recorded) if rows] if backend.precision != "fp32" else []
    full: dict[int, Tensor] = {}
    if shifted:
        with backend.full_precision():
            full = dict(zip(shifted, backend.each(lambda k: backend.logprobs(batches[k]), shifted), strict=True))
    beh: list[Tensor | FromStep] = []
    for k, rows in enumerate(recorded):
        if k in stand_in:
            beh.append(FromStep(rows, full.get(k), reference=fresh))
            continue
        lp = start[k] if need_start else ref[k]
        beh.append(backend.with_recorded(lp, rows, lp - full[k] if k in full else None))
    return ref, extras, beh


def _mean_kl(backend: Backend, batches: list[Batch], ref: list[Tensor]) -> float:
    """The active model's mean k3 KL to ``ref`` per response token (a forward per micro-batch)."""
    sums = backend.each(lambda k: backend.kl_sum(batches[k], ref[k]), range(len(batches)))
    return sum(kl for kl, _ in sums) / max(sum(n for _, n in sums), 1)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
