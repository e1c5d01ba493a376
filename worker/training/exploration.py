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
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..gate import repeated_ngrams
from ..presets import TrainConfig
from ..samples import TrainSample
from .advantages import group_advantages
from .backend import Backend
from .feature_memo import DrawKey, Draws, Memo, Rows, prompt_seed
from .reward_features import RewardModelReport, features_with_endings, labelled

SAMPLE_ROWS = 64  # answers one generate call samples at once (memory grows with the batch)
# An explored answer that repeats more of its own trigrams than this ranks last in its group, whatever
# the reward model says: a model fitted on tens of ratings knows nothing of fluency, and reinforcing a
# looping answer it happens to like is how repetition creeps in (the gate bounds it, see worker/gate.py).
REPEAT_GUARD = 0.1
# A sentence's end: its mark (and any closing quote or bracket) followed by white space, so that a
# decimal point or an abbreviation inside a word is not one.
_SENTENCE_END = re.compile(r"[.!?…][\"')\]]*(?=\s)")


@dataclass(frozen=True)
class Exploration:
    """What a run explored: the answers it trains on beside the ratings, the advantage of each, and
    the run's figures on it (``explored`` is 0 and ``reason`` says why when nothing was sampled)."""

    samples: list[TrainSample] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)  # each answer's prompt, as an index into the explored prompts
    reason: str = ""
    seconds: float = 0.0
    looping: int = 0  # explored answers ranked last for repeating themselves (REPEAT_GUARD)
    cut: int = 0  # explored answers cut off at train.explore_max_new_tokens (trained without an end token)
    ended_earlier: int = 0  # answers ended at an earlier sentence end that the reward model scored higher
    known: int = 0  # prompts whose answers the worker had drawn before the run (draw_ahead)

    def metrics(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "explored": len(self.samples), "explore_reason": self.reason, "explore_seconds": self.seconds,
            "explored_looping": self.looping, "explored_cut": self.cut, "explored_ended_earlier": self.ended_earlier,
            "explored_known": self.known}
        spread = quartiles([abs(a) for a in self.advantages])
        if spread is not None:
            q1, median, q3 = spread
            out.update(explored_abs_advantage_q1=q1, explored_abs_advantage_median=median,
                       explored_abs_advantage_q3=q3)
        return out


def why_not(report: RewardModelReport, cfg: TrainConfig) -> str | None:
    """Why this run does not explore, or None when it does."""
    if cfg.explore <= 0:
        return "off (train.explore = 0)"
    return report.unusable(cfg.reward_model_min_auc)


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


def fluent_first(scores: list[float], looping: Sequence[bool], groups: Sequence[int]) -> list[float]:
    """``scores`` with every ``looping`` answer moved below the lowest of its group (``groups[i]``:
    answer i's group)."""
    out = list(scores)
    for g in set(groups):
        members = [i for i, gi in enumerate(groups) if gi == g]
        floor = min(out[i] for i in members) - 1.0
        for i in members:
            if looping[i]:
                out[i] = floor
    return out


def earlier_endings(text: str, n: int) -> list[str]:
    """``text`` ended at each of its first ``n`` sentence ends that leave more of it after them (the
    whole answer is not among them), trailing white space dropped."""
    out: list[str] = []
    for end in _SENTENCE_END.finditer(text):
        if len(out) >= n:
            break
        if text[end.end():].strip():
            out.append(text[:end.end()].rstrip())
    return out


def quartiles(values: Sequence[float]) -> list[float] | None:
    """The 25th, 50th and 75th percentiles of ``values`` (nearest rank), None for none.

    Reported for the explored answers' advantages: every one costs a full share of each optimizer
    step, so how many of them carry next to nothing says what a cheaper run could leave out."""
    if not values:
        return None
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.25, 0.5, 0.75)]


def minibatches(groups: Sequence[int], n: int) -> list[list[int]]:
    """The explored answers' indices (``groups[i]``: answer i's prompt) in up to ``n`` minibatches of
    whole prompt groups, prompt g in minibatch g mod n, none empty.

    A run trains one per optimizer step in turn beside the ratings: each answer then costs
    steps / n passes instead of one per step, which on a CPU is most of an exploring run's time, and
    a prompt's answers, centred on their own mean, still meet in the same step."""
    parts: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        parts.setdefault(g % max(n, 1), []).append(i)
    return [parts[k] for k in sorted(parts)]


def ending_candidates(answers: Sequence[TrainSample], n: int) -> list[list[TrainSample]]:
    """Per answer, its :func:`earlier_endings` (up to ``n``) as answers of their own, each ended there."""
    return [[TrainSample(rating_id=None, prompt=s.prompt, response=head, reward=0.0)
             for head in earlier_endings(s.response, n)] for s in answers]


def better_endings(scored: Sequence[tuple[TrainSample, float]],
                   endings: Sequence[Sequence[tuple[TrainSample, float]]]) -> list[tuple[int, TrainSample, float]]:
    """For each ``(answer, its score)``, the one of its scored earlier endings (``endings[i]``, from
    :func:`ending_candidates`) the reward model scores highest, where that beats the whole answer:
    ``(index of the answer, the ended answer, its score)``.

    A taste for shorter answers shows in the policy's own answers ended sooner, which the reward model
    can judge without a sample drawn: a run then compares an answer with its own first sentences, the
    one difference being where it ends. Where the taste is about something else, the model scores the
    endings no higher and nothing is added."""
    best: dict[int, tuple[TrainSample, float]] = {}
    for i, ((_, own), cands) in enumerate(zip(scored, endings, strict=True)):
        for cand, score in cands:
            if score > own and (i not in best or score > best[i][1]):
                best[i] = (cand, float(score))
    return [(i, cand, score) for i, (cand, score) in sorted(best.items())]


def draw_key(prompt: list[dict], cfg: TrainConfig) -> DrawKey:
    """What a prompt's explored answers are remembered under (beside the model that drew them)."""
    return json.dumps(prompt, sort_keys=True), cfg.explore, cfg.explore_max_new_tokens, cfg.seed


def draws(backend: Backend, prompts: Sequence[list[dict]], cfg: TrainConfig, drawn: Draws | None = None
          ) -> list[list[int]]:
    """``cfg.explore`` answers to each of ``prompts`` from the active model, as token ids, prompt after
    prompt: those ``drawn`` remembers for it (the worker drew them while it waited:
    :func:`draw_ahead`), the others sampled now, batched, and remembered there."""
    k = cfg.explore
    keys = [draw_key(p, cfg) for p in prompts]
    missing = [i for i, key in enumerate(keys) if drawn is None or key not in drawn]
    rows = [prompts[i] for i in missing for _ in range(k)]
    answers: list[list[int]] = []
    for start in range(0, len(rows), SAMPLE_ROWS):
        # seeded per chunk (the torch backend draws one stream per batch, MLX seed + row)
        answers += backend.sample(rows[start:start + SAMPLE_ROWS], cfg.explore_max_new_tokens, cfg.seed + start)
    fresh = {i: answers[m * k:(m + 1) * k] for m, i in enumerate(missing)}
    if drawn is None:
        return answers
    drawn.update({keys[i]: got for i, got in fresh.items()})
    return [ids for key in keys for ids in drawn[key]]


def draw_ahead(backend: Backend, prompts: Sequence[list[dict]], cfg: TrainConfig, memo: Memo,
               stop: Callable[[], bool] = lambda: False) -> int:
    """Draw and pool, into ``memo``, the explored answers of each of ``prompts`` that it does not hold
    yet, as :func:`explore` would under the active model, prompt by prompt until ``stop()`` says to let
    go; returns how many prompts it did. Each prompt's answers are one batch, seeded by the run's seed
    and the prompt (whichever prompts come before it), so they are the same whenever they are drawn."""
    done = 0
    for prompt in prompts:
        key = draw_key(prompt, cfg)
        if key in memo.drawn:
            continue
        if stop():
            break
        rows = [prompt] * cfg.explore
        answers = backend.sample(rows, cfg.explore_max_new_tokens, prompt_seed(prompt, cfg.seed))
        pool_answers(backend, prompt, answers, cfg, memo.pooled)
        memo.drawn[key] = answers  # last: a prompt is drawn ahead once its features are pooled too
        done += 1
    return done


def pool_answers(backend: Backend, prompt: list[dict], answers: Sequence[list[int]], cfg: TrainConfig,
                 known: Rows) -> None:
    """Pool ``prompt``'s drawn ``answers`` and the earlier endings :func:`explore` scores, under the
    active model, into ``known`` (what is there already is not run again)."""
    explored, _, heads = as_samples(backend, [prompt] * len(answers), answers, cfg)
    features_with_endings(backend, explored, heads, cfg.max_tokens, known)


def as_samples(backend: Backend, rows: Sequence[list[dict]], answers: Sequence[list[int]], cfg: TrainConfig
               ) -> tuple[list[TrainSample], list[bool], list[list[TrainSample]]]:
    """The drawn ``answers`` (one per prompt in ``rows``) as samples, whether each loops
    (:func:`loops`), and the earlier endings the reward model scores for each (none for a looping one:
    it ranks last whatever it scores, :func:`fluent_first`)."""
    tok = backend.tokenizer
    # An answer as long as the cap did not end: it trains without an end token (TrainSample.complete).
    cap = cfg.explore_max_new_tokens
    explored = [TrainSample(rating_id=None, prompt=p, response=tok.decode(ids, skip_special_tokens=True), reward=0.0,
                            complete=len(ids) < cap)
                for p, ids in zip(rows, answers, strict=True)]
    looping = loops(answers)
    heads = [[] if loop else cuts for cuts, loop in zip(ending_candidates(explored, cfg.explore_cuts), looping,
                                                           strict=True)]
    return explored, looping, heads


def explore(backend: Backend, samples: Sequence[TrainSample], report: RewardModelReport,
            cfg: TrainConfig, captured: Sequence[list[dict]] = (), memo: Memo | None = None) -> Exploration:
    """Sample, score and weigh the run's explored answers under the active model (the policy the run
    starts from); nothing is sampled when :func:`why_not` gives a reason. ``memo``: what the worker
    drew and pooled under that model while it waited (:func:`draw_ahead`), read instead of done again."""
    started = time.perf_counter()
    refused = why_not(report, cfg)
    if refused is not None or report.model is None:
        return Exploration(reason=refused or "no reward model", seconds=time.perf_counter() - started)
    k = cfg.explore
    prompts = prompts_to_explore(samples, cfg.explore_prompts, captured)
    known = 0 if memo is None else sum(draw_key(p, cfg) in memo.drawn for p in prompts)
    drawn = draws(backend, prompts, cfg, None if memo is None else memo.drawn)
    explored, looping, heads = as_samples(backend, [p for p in prompts for _ in range(k)], drawn, cfg)
    model = report.model
    own, ended_features = features_with_endings(backend, explored, heads, cfg.max_tokens,
                                                None if memo is None else memo.pooled)
    scores = model.score(own).tolist()
    groups = [i // k for i in range(len(explored))]
    n_cut = sum(not s.complete for s in explored)
    index = [i for i, loop in enumerate(looping) if not loop]
    ended = better_endings(
        [(explored[i], scores[i]) for i in index],
        [list(zip(heads[i], model.score(ended_features[i]).tolist() if heads[i] else [], strict=True))
         for i in index])
    for j, sample, score in ended:  # each beside its answer, in its group
        explored.append(sample)
        scores.append(score)
        looping.append(False)
        groups.append(groups[index[j]])
    scores = fluent_first(scores, looping, groups)
    advantages = [0.0] * len(explored)
    for g in range(len(prompts)):
        members = [i for i, gi in enumerate(groups) if gi == g]
        for i, a in zip(members, group_advantages([scores[i] for i in members], cfg.explore_weight, cfg.adv_clip),
                        strict=True):
            advantages[i] = a
    reason = (f"{k} answers to each of {len(prompts)} prompts, reward model AUC {report.auc:.3f} "
              f">= {cfg.reward_model_min_auc}")
    return Exploration(explored, advantages, groups, reason, time.perf_counter() - started, sum(looping), n_cut,
                       len(ended), known)
