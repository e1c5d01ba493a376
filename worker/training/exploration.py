"""Exploration: answers the run samples itself and scores with the user's reward model.

A preference the model rarely shows leaves a run almost only 👎s, and a 👎 cannot teach what the
model never produced. Several answers per prompt find the rare liked one far more often than one
does, so when the run's reward model (:mod:`.reward_features`) ranks held-out ratings well enough
(cross-validated AUC at least ``train.reward_model_min_auc``), the run samples ``train.explore``
answers for each of up to ``train.explore_prompts`` prompts from the policy it starts from (its
rated prompts and those of recent answers nobody rated, taken in turn, the newest of each first),
scores them with the model refitted on every labelled answer, and trains on them with
group-relative advantages (:func:`.advantages.group_advantages`) beside the ratings.

An explored answer is not a rating: it has no rating id, so the ledger, the reward EMA and the gate's
held-out set never see it, and the user's own rated answers keep the advantages their ratings give
them (the reward model never overrides a rating). It has no recorded log-probs: its behaviour policy
is the run's starting policy, which sampled it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..gate import repeated_ngrams
from ..presets import TrainConfig
from ..samples import TrainSample
from .advantages import group_advantages
from .backend import Backend
from .reward_features import RewardModelReport, features, labelled

SAMPLE_ROWS = 64  # answers one generate call samples at once (memory grows with the batch)
# An explored answer that repeats more of its own trigrams than this ranks last in its group, whatever
# the reward model says: a model fitted on tens of ratings knows nothing of fluency, and reinforcing a
# looping answer it happens to like is how repetition creeps in (the gate bounds it, see worker/gate.py).
REPEAT_GUARD = 0.1


@dataclass(frozen=True)
class Exploration:
    """What a run explored: the answers it trains on beside the ratings, the advantage of each, and
    the run's figures on it (``explored`` is 0 and ``reason`` says why when nothing was sampled)."""

    samples: list[TrainSample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0
    looping: int = 0  # explored answers ranked last for repeating themselves (REPEAT_GUARD)
    cut: int = 0  # explored answers cut off at train.explore_max_new_tokens (trained without an end token)

    def metrics(self) -> dict[str, float | int | str]:
        return {"explored": len(self.samples), "explore_reason": self.reason, "explore_seconds": self.seconds,
                "explored_looping": self.looping, "explored_cut": self.cut}


def why_not(report: RewardModelReport, cfg: TrainConfig) -> str | None:
    """Why this run does not explore, or None when it does."""
    if cfg.explore <= 0:
        return "off (train.explore = 0)"
    if report.auc is None or report.model is None:
        return f"no reward model: {report.reason}"
    if report.auc < cfg.reward_model_min_auc:
        return f"reward model AUC {report.auc:.3f} below train.reward_model_min_auc {cfg.reward_model_min_auc}"
    return None


def prompts_to_explore(samples: Sequence[TrainSample], n: int,
                       captured: Sequence[list[dict]] = ()) -> list[list[dict]]:
    """Up to ``n`` distinct prompts: the run's labelled ratings' (the newest rating's first) and the
    ``captured`` ones (newest first), taken in turn, so that a run of many ratings still explores what
    the user asked and did not rate, and one of few ratings fills up with captured prompts."""
    rated = [s.prompt for s in sorted(labelled(samples), key=lambda s: -(s.rating_id or 0))]
    return distinct(_in_turn(rated, list(captured)))[:n]


def distinct(prompts: Sequence[list[dict]]) -> list[list[dict]]:
    """``prompts`` without repeats, in their order (the first of equal ones kept)."""
    seen: set[str] = set()
    out: list[list[dict]] = []
    for prompt in prompts:
        key = json.dumps(prompt, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(prompt)
    return out


def _in_turn(a: list[list[dict]], b: list[list[dict]]) -> list[list[dict]]:
    """``a[0], b[0], a[1], b[1], ...``, the longer one's rest at the end."""
    out = [x for pair in zip(a, b, strict=False) for x in pair]
    return out + a[len(b):] + b[len(a):]


def loops(answers: Sequence[Sequence[int]]) -> list[bool]:
    """Per answer, whether it repeats more of its own trigrams than :data:`REPEAT_GUARD`."""
    return [repeated_ngrams(list(a)) > REPEAT_GUARD for a in answers]


def fluent_first(scores: list[float], looping: Sequence[bool], k: int) -> list[float]:
    """``scores`` with every ``looping`` answer moved below the lowest of its group of ``k``."""
    out = list(scores)
    for g in range(0, len(out), k):
        floor = min(out[g:g + k]) - 1.0
        for i in range(g, min(g + k, len(out))):
            if looping[i]:
                out[i] = floor
    return out


def explore(backend: Backend, samples: Sequence[TrainSample], report: RewardModelReport,
            cfg: TrainConfig, captured: Sequence[list[dict]] = ()) -> Exploration:
    """Sample, score and weigh the run's explored answers under the active model (the policy the run
    starts from); nothing is sampled when :func:`why_not` gives a reason."""
    started = time.perf_counter()
    refused = why_not(report, cfg)
    if refused is not None or report.model is None:
        return Exploration(reason=refused or "no reward model", seconds=time.perf_counter() - started)
    k = cfg.explore
    prompts = prompts_to_explore(samples, cfg.explore_prompts, captured)
    rows = [p for p in prompts for _ in range(k)]
    answers: list[list[int]] = []
    for start in range(0, len(rows), SAMPLE_ROWS):
        # seeded per chunk (the torch backend draws one stream per batch, MLX seed + row)
        answers += backend.sample(rows[start:start + SAMPLE_ROWS], cfg.explore_max_new_tokens, cfg.seed + start)
    tok = backend.tokenizer
    # An answer as long as the cap did not end: it trains without an end token (TrainSample.complete).
    cap = cfg.explore_max_new_tokens
    explored = [TrainSample(rating_id=None, prompt=p, response=tok.decode(ids, skip_special_tokens=True), reward=0.0,
                            complete=len(ids) < cap)
                for p, ids in zip(rows, answers, strict=True)]
    looping = loops(answers)
    scores = fluent_first(report.model.score(features(backend, explored, cfg.max_tokens)).tolist(), looping, k)
    advantages: list[float] = []
    for g in range(len(prompts)):
        advantages += group_advantages(scores[g * k:(g + 1) * k], cfg.explore_weight, cfg.adv_clip)
    reason = (f"{k} answers to each of {len(prompts)} prompts, reward model AUC {report.auc:.3f} "
              f">= {cfg.reward_model_min_auc}")
    return Exploration(explored, advantages, reason, time.perf_counter() - started, sum(looping),
                       sum(not s.complete for s in explored))
