"""The evaluation gate: which ratings a run holds out, and whether its candidate may be served.

Pure functions over plain numbers; `worker/training/scoring.py` measures the models, `worker/orchestrate.py` acts
on the verdict. A candidate is compared with its parent (the version served when the run started,
or the base) on ratings the run never trained on:

- margin: the mean per-token log-probability of held-out good answers minus that of bad ones. The
  candidate must not fall below the parent's by more than the noise of the paired differences;
- KL to the base on the held-out answers, under a cap; a much lower cap when the held-out answers
  are all of one class: then the margin is one-sided (all bad: minus their mean log-prob), and a
  model that lowers every likelihood, i.e. drifts towards noise, looks better on it. Unless the
  held-out ratings came with words: then the hindsight teacher (the model reading them) is the
  other side, and a candidate whose next-token distributions on those answers came closer to the
  teacher's than its parent's were, beyond noise, has learnt what the words asked, which drift does
  not do; it gets the usual cap;
- collapse: the entropy of the next-token distribution on held-out answers, and the distinct
  bigrams and length of sampled answers, must not fall far below the base's;
- degeneration: answers that loop ("my dear, my dear, my dear!") or a next-token distribution
  blurred well past the base's: the entropy has an upper bound too, and the share of repeated
  trigrams inside each sampled answer may not rise much above the base's.

Each check is there because the learning benchmark served candidates that failed it; the
measurements are in bench/RESULTS.md, the rules in docs/objective.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class GateConfig:
    enabled: bool = True
    holdout_frac: float = 0.15
    min_holdout: int = 4  # fewer rated answers than 2x this: the run is not gated (said in its verdict)
    noise_sigmas: float = 2.0  # the margin may fall this many standard errors (of paired deltas)...
    min_noise: float = 0.02  # ...or this much in nats per token, whichever is larger, before rejection
    max_kl: float = 0.5  # mean per-token KL(candidate || base) on held-out answers, nats
    max_kl_one_class: float = 0.1  # the cap when every held-out answer is good, or every one bad
    # The held-out answers' words read by the hindsight teacher (its top K tokens; 0: not read) lift the
    # one-class cap for a candidate that came closer to the teacher (module docstring).
    hint_top_k: int = 0
    hint_teacher: str | None = None  # None: the base with the words in its context
    min_hinted: int = 2  # fewer held-out answers with words than this: no paired noise, no lift
    min_entropy_ratio: float = 0.4  # candidate / base next-token entropy on held-out answers
    # Candidate / base distinct bigrams of sampled answers: the product's other fluency bound. A taste
    # that narrows what the model says (a habit in every answer) can take it well under the base's while
    # repetition stays low; versions that kept their fluency read 0.92x or more (bench/RESULTS.md).
    min_distinct_ratio: float = 0.9
    max_entropy_ratio: float = 1.3  # above this the candidate is blurring towards noise
    # Mean repeated-trigram share of sampled answers, over the base's: the product's fluency bound.
    # Thirty-two answers read the base's within about a point (8 read a version the benchmark saw
    # repeating 13 % at 5 %); bench/RESULTS.md has the measurements.
    max_repetition_rise: float = 0.03
    min_answer_tokens: float = 2.0  # mean sampled length below this (base above 4x it) is collapse
    # Answers sampled for the collapse checks, cycling through the held-out prompts (0: teacher-forced
    # only): one looping answer in 32 moves the mean by about a point.
    eval_samples: int = 32
    eval_new_tokens: int = 48
    # Sampled the way the chat answers (`chat.temperature`, `chat.top_p`): the gate judges the answers
    # users will get, whatever top-p they chose.
    eval_temperature: float = 0.7
    eval_top_p: float = 0.9


@dataclass(frozen=True)
class ModelScores:
    """One model measured on the held-out set."""

    logprobs: list[float]  # mean per-token log-prob of each held-out answer
    kl: float  # mean per-token KL to the base over all held-out answer tokens (0 for the base)
    entropy: float  # mean next-token entropy over held-out answer positions
    distinct2: float | None = None  # distinct bigram fraction of sampled answers
    answer_tokens: float | None = None  # mean sampled answer length
    repetition: float | None = None  # mean share of repeated trigrams within each sampled answer

    @classmethod
    def from_sums(
        cls,
        lp_sum: Sequence[float],
        ent_sum: Sequence[float],
        kl_sum: Sequence[float],
        count: Sequence[int],
        sampled: Sequence[Sequence[int]] | None,
    ) -> ModelScores:
        """From per-answer sums over answer tokens (and the token lists of sampled answers, if any)."""
        total = max(sum(count), 1)
        return cls(
            logprobs=[s / max(c, 1) for s, c in zip(lp_sum, count, strict=True)],
            kl=sum(kl_sum) / total,
            entropy=sum(ent_sum) / total,
            distinct2=distinct_n(sampled, 2) if sampled else None,
            answer_tokens=sum(len(o) for o in sampled) / len(sampled) if sampled else None,
            repetition=repetition(sampled) if sampled else None,
        )


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reason: str | None
    metrics: dict[str, float | int | str | None] = field(default_factory=dict)


def split_holdout(
    items: Sequence[T], rewards: Sequence[float], frac: float, min_n: int
) -> tuple[list[T], list[T]]:
    """``(train, held_out)``: the newest ``frac`` of each class (items come oldest first), at least
    ``min_n`` in all, and nothing held out when that would leave fewer to train on than to test.

    Per class, so a run with few bad ratings still tests on some; newest, so the test is the
    user's current taste and the held-out ratings train the next run.
    """
    n = len(items)
    want = max(min_n, round(frac * n))
    if n < 2 * min_n or want > n // 2:
        return list(items), []
    classes: dict[bool, list[int]] = {True: [], False: []}
    for i, r in enumerate(rewards):
        classes[r > 0].append(i)
    quota = {k: round(want * len(v) / n) for k, v in classes.items()}
    for k, v in classes.items():  # each class present twice or more is represented
        if len(v) >= 2 and quota[k] == 0:
            quota[k] = 1
    while sum(quota.values()) < want:
        k = max(classes, key=lambda c: len(classes[c]) - quota[c])
        quota[k] += 1
    held = {i for k, v in classes.items() for i in v[len(v) - quota[k]:]}
    return [x for i, x in enumerate(items) if i not in held], [x for i, x in enumerate(items) if i in held]


def margin(logprobs: Sequence[float], rewards: Sequence[float]) -> float:
    """Mean log-prob of good answers minus that of bad ones (one side alone when the other is absent)."""
    good = [lp for lp, r in zip(logprobs, rewards, strict=True) if r > 0]
    bad = [lp for lp, r in zip(logprobs, rewards, strict=True) if r <= 0]
    return (_mean(good) if good else 0.0) - (_mean(bad) if bad else 0.0)


def paired_noise(cand: Sequence[float], parent: Sequence[float], rewards: Sequence[float]) -> float:
    """Standard error of the margin's change, from the per-answer changes ``cand - parent`` of each
    class (pooled variance around each class's mean change)."""
    by_class: dict[bool, list[float]] = {True: [], False: []}
    for c, p, r in zip(cand, parent, rewards, strict=True):
        by_class[r > 0].append(c - p)
    present = [d for d in by_class.values() if d]
    dof = sum(len(d) for d in present) - len(present)
    if dof < 1:
        return float("inf")
    pooled = sum((x - _mean(d)) ** 2 for d in present for x in d) / dof
    return math.sqrt(pooled * sum(1 / len(d) for d in present))


def one_class(rewards: Sequence[float]) -> bool:
    """Every held-out answer good, or every one bad: the margin is one-sided."""
    return len({r > 0 for r in rewards}) == 1


def distinct_n(token_lists: Sequence[Sequence[int | str]], n: int = 2) -> float:
    """Distinct n-grams over all n-grams of the answers (1.0 when there are none to count)."""
    grams = [tuple(t[i : i + n]) for t in token_lists for i in range(len(t) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def repeated_ngrams(tokens: Sequence[int | str], n: int = 3) -> float:
    """Share of one answer's n-grams that already occurred earlier in it (0.0 when it has none)."""
    return 1.0 - distinct_n([tokens], n)


def repetition(token_lists: Sequence[Sequence[int | str]], n: int = 3) -> float:
    """Mean share of repeated n-grams within each answer (0.0 for no answers): what the gate bounds."""
    return sum(repeated_ngrams(t, n) for t in token_lists) / len(token_lists) if token_lists else 0.0


def sample_plan(prompts: Sequence[T], n: int) -> list[T]:
    """The ``n`` prompts to sample answers for: the held-out ones in turn, repeated as needed."""
    return [prompts[i % len(prompts)] for i in range(n)] if prompts else []


@dataclass(frozen=True)
class TowardHints:
    """The held-out answers that came with words: per answer, the parent's and the candidate's mean
    per-token divergence from the hindsight teacher reading those words."""

    parent: list[float]
    cand: list[float]

    def moved(self, cfg: GateConfig) -> tuple[float, float]:
        """The candidate's mean change (negative: closer to the teacher) and the noise it must clear:
        ``cfg.noise_sigmas`` standard errors of the paired changes, or ``cfg.min_noise``."""
        mean = _mean([c - p for c, p in zip(self.cand, self.parent, strict=True)])
        se = paired_noise(self.cand, self.parent, [0.0] * len(self.cand))  # one class: the plain paired SE
        return mean, max(cfg.min_noise, cfg.noise_sigmas * se)


def judge(
    rewards: Sequence[float], base: ModelScores, parent: ModelScores, cand: ModelScores, cfg: GateConfig,
    hints: TowardHints | None = None,
) -> Verdict:
    """Promote ``cand`` unless it is worse than ``parent`` beyond noise, drifts too far, or collapses;
    ``hints`` (the held-out answers' words, read by the hindsight teacher) can vouch for a candidate
    judged on one class alone."""
    m_parent = margin(parent.logprobs, rewards)
    m_cand = margin(cand.logprobs, rewards)
    noise = max(cfg.min_noise, cfg.noise_sigmas * paired_noise(cand.logprobs, parent.logprobs, rewards))
    entropy_ratio = cand.entropy / base.entropy if base.entropy > 0 else 1.0
    metrics: dict[str, float | int | str | None] = {
        "heldout_n": len(rewards),
        "heldout_good": sum(1 for r in rewards if r > 0),
        "heldout_margin_before": m_parent,
        "heldout_margin_after": m_cand,
        "heldout_noise": noise,
        "heldout_kl": cand.kl,
        "entropy_ratio": entropy_ratio,
    }
    distinct_ratio = None
    if cand.distinct2 is not None and base.distinct2:
        distinct_ratio = cand.distinct2 / base.distinct2
        metrics["distinct2_ratio"] = distinct_ratio
    if cand.answer_tokens is not None:
        metrics["answer_tokens"] = cand.answer_tokens
        metrics["answer_tokens_base"] = base.answer_tokens
    repetition_rise = None
    if cand.repetition is not None and base.repetition is not None:
        repetition_rise = cand.repetition - base.repetition
        metrics["repetition"] = cand.repetition
        metrics["repetition_base"] = base.repetition

    single = one_class(rewards)
    toward = False
    if hints is not None and len(hints.cand) >= cfg.min_hinted:
        moved, hint_noise = hints.moved(cfg)
        toward = moved < -hint_noise
        metrics.update(heldout_hinted=len(hints.cand), heldout_teacher_div_before=_mean(hints.parent),
                       heldout_teacher_div_after=_mean(hints.cand), heldout_teacher_noise=hint_noise,
                       heldout_toward_teacher=toward)
    kl_cap = min(cfg.max_kl, cfg.max_kl_one_class) if single and not toward else cfg.max_kl
    metrics["heldout_one_class"] = single

    reasons = []
    if not all(math.isfinite(x) for x in (m_cand, cand.kl, cand.entropy)):
        reasons.append("non-finite scores on the held-out answers")
    if m_cand < m_parent - noise:
        reasons.append(f"held-out margin fell from {m_parent:+.3f} to {m_cand:+.3f} (noise ±{noise:.3f})")
    if cand.kl > kl_cap:
        why = ""
        if single and not toward:
            kind = "good" if rewards and rewards[0] > 0 else "bad"
            why = f" (only {kind} answers held out: drift and learning look alike, so the cap is lower)"
        reasons.append(f"KL to the base {cand.kl:.3f} > {kl_cap}{why}")
    if entropy_ratio < cfg.min_entropy_ratio:
        reasons.append(f"collapse: entropy {entropy_ratio:.2f}x the base's")
    if entropy_ratio > cfg.max_entropy_ratio:
        reasons.append(f"degenerating: next-token entropy {entropy_ratio:.2f}x the base's (> {cfg.max_entropy_ratio})")
    if repetition_rise is not None and repetition_rise > cfg.max_repetition_rise:
        reasons.append(
            f"degenerating: sampled answers repeat {cand.repetition:.0%} of their trigrams (base {base.repetition:.0%})"
        )
    if distinct_ratio is not None and distinct_ratio < cfg.min_distinct_ratio:
        reasons.append(f"collapse: distinct bigrams {distinct_ratio:.2f}x the base's")
    if (
        cand.answer_tokens is not None
        and base.answer_tokens is not None
        and cand.answer_tokens < cfg.min_answer_tokens <= base.answer_tokens / 4
    ):
        reasons.append(f"collapse: answers shrank to {cand.answer_tokens:.1f} tokens")
    verdict = "rejected" if reasons else "promoted"
    metrics["verdict"] = verdict
    return Verdict(promote=not reasons, reason="; ".join(reasons) or None, metrics=metrics)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
