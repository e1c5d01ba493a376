"""What the reward model (:mod:`.reward_model`) sees of a rated answer, and the run's report on it.

Features of one answer, under the active model (in a run: the policy the run starts from):

- the policy's own representation of the answer: the last hidden layer averaged over the answer's
  tokens (``Backend.pooled_hidden``), whatever the model has learned to notice about it;
- three plain statistics a person's taste often hangs on and a mean over tokens blurs:
  ``log(answer tokens)`` (the length, end token included), ``log(1 + words)`` (the length a reader
  sees: answers cut at the same token cap differ in words) and the share of the answer's words that
  end a sentence (short sentences versus long ones).

Labels: a liked answer 1, a disliked one 0. Retractions have no label (the rating was undone or
replaced; the user no longer holds it); replayed ratings do, and so do the user's earlier ratings
the run is handed for it (:func:`with_history`; still-active ratings of the same user, which is what
the model is of, and more of them makes a better fit on tens of answers).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..batching import Encoded, encode_sample
from ..samples import TrainSample
from .backend import Backend
from .feature_memo import RowKey, Rows, row_key
from .reward_model import MAX_FOLDS, CrossValidated, RewardModel, best_of, why_not
from .scoring import EVAL_BATCH_TOKENS

_SENTENCE_ENDS = (".", "!", "?", "…", '."', '!"', '?"')
N_STATISTICS = 3  # the columns answer_statistics adds after the hidden state
# What the model may be fitted on; the run keeps whichever cross-validates best (reward_model.best_of).
FEATURE_SETS = {
    "answer statistics": slice(-N_STATISTICS, None),
    "hidden state and answer statistics": slice(None),
}


@dataclass(frozen=True)
class RewardModelReport:
    """A run's figures on its reward model, as the run's metrics carry them, and (where the AUC was
    measured) the model refitted on every labelled answer, which exploration scores answers with."""

    auc: float | None
    reason: str
    seconds: float
    model: RewardModel | None = None
    known: int = 0  # answers whose features were remembered from the worker's idle time, not computed

    def metrics(self) -> dict[str, float | str | None]:
        return {"reward_model_auc": self.auc, "reward_model_reason": self.reason,
                "reward_model_seconds": self.seconds, "reward_model_known": self.known}

    def unusable(self, min_auc: float) -> str | None:
        """Why answers may not be scored with this model (none fitted, or its AUC under ``min_auc``:
        ``train.reward_model_min_auc``), or None when they may."""
        if self.auc is None or self.model is None:
            return f"no reward model: {self.reason}"
        if self.auc < min_auc:
            return f"reward model AUC {self.auc:.3f} below train.reward_model_min_auc {min_auc}"
        return None


def answer_statistics(response: str, n_tokens: int) -> list[float]:
    """``[log(n_tokens), log(1 + words), share of words that end a sentence]`` (0 for an empty answer)."""
    words = response.split()
    ends = sum(w.endswith(_SENTENCE_ENDS) for w in words)
    return [math.log(max(n_tokens, 1)), math.log1p(len(words)), ends / len(words) if words else 0.0]


def with_history(samples: Sequence[TrainSample], history: Sequence[TrainSample]) -> list[TrainSample]:
    """The run's samples, then the earlier ratings in ``history`` that are not among them (a replayed
    rating is both): what the reward model learns from. A rare liked answer counts in every later run,
    not only in the run that consumed it."""
    have = {s.rating_id for s in samples if s.rating_id is not None}
    return list(samples) + [s for s in history if s.rating_id is None or s.rating_id not in have]


def labelled(samples: Sequence[TrainSample]) -> list[TrainSample]:
    """The samples that carry a rating the user holds: every one but the retractions."""
    return [s for s in samples if s.fixed_advantage is None]


def features(backend: Backend, samples: Sequence[TrainSample], max_tokens: int) -> np.ndarray:
    """``[n, hidden + 3]``: per sample its pooled last hidden state, then :func:`answer_statistics`."""
    return _features(backend, samples, max_tokens)[0]


def _features(backend: Backend, samples: Sequence[TrainSample], max_tokens: int,
              known: Mapping[RowKey, list[float]] | None = None) -> tuple[np.ndarray, int]:
    """:func:`features`, the hidden states taken from ``known`` where the active model already pooled
    a row (:mod:`.feature_memo`); and how many were."""
    encoded = [encode_sample(backend.tokenizer, s, max_tokens) for s in samples]
    pooled, n_known = _pooled(backend, encoded, known)
    return _with_statistics(pooled, samples, encoded), n_known


def remember(backend: Backend, samples: Sequence[TrainSample], max_tokens: int, rows: Rows,
             stop: Callable[[], bool] = lambda: False, logprobs: Rows | None = None) -> int:
    """Pool ``samples``' answers under the active model into ``rows`` where they are not there yet,
    a batch at a time, until ``stop()`` says to let go; returns how many it added. The batches are
    smaller than a run's measurements: whoever stops this waits for the batch in hand. ``logprobs``:
    the log-probs the pass keeps beside (the torch trainer's), where a row missing from them runs
    again although its features are there (a bf16 session pooled it under this model before, when it
    kept none)."""
    encoded = [encode_sample(backend.tokenizer, s, max_tokens) for s in samples]
    todo = list({row_key(e): e for e in encoded
                 if row_key(e) not in rows or (logprobs is not None and row_key(e) not in logprobs)}.values())
    added = 0
    for i, row in _pooled_rows(backend, todo, EVAL_BATCH_TOKENS // 4, stop):
        rows[row_key(todo[i])] = row
        added += 1
    return added


def _pooled_rows(backend: Backend, encoded: Sequence[Encoded], budget: int = EVAL_BATCH_TOKENS,
                 stop: Callable[[], bool] = lambda: False) -> Iterator[tuple[int, list[float]]]:
    """``(index, pooled last hidden state)`` of ``encoded``'s rows (:meth:`Backend.pooled_hidden`), a
    batch of ``budget`` padded tokens at a time, until ``stop()`` says to let go."""
    for g, batch in zip(*backend.batches(encoded, budget), strict=True):
        if stop():
            return
        yield from zip(g, backend.pooled_hidden(batch), strict=True)


def _pooled(backend: Backend, encoded: Sequence[Encoded],
            known: Mapping[RowKey, list[float]] | None = None) -> tuple[list[list[float]], int]:
    """Each encoded row's pooled last hidden state (:meth:`Backend.pooled_hidden`), in order, taken
    from ``known`` where it is there; and how many were."""
    pooled: list[list[float]] = [[] for _ in encoded]
    todo: list[int] = []
    for i, e in enumerate(encoded):
        hit = None if known is None else known.get(row_key(e))
        if hit is None:
            todo.append(i)
        else:
            pooled[i] = hit
    for j, row in _pooled_rows(backend, [encoded[i] for i in todo]):
        pooled[todo[j]] = row
    return pooled, len(encoded) - len(todo)


def _with_statistics(pooled: Sequence[list[float]], samples: Sequence[TrainSample],
                     encoded: Sequence[Encoded]) -> np.ndarray:
    """The pooled vectors with each sample's :func:`answer_statistics` after its own."""
    stats = [answer_statistics(s.response, e.n_response) for s, e in zip(samples, encoded, strict=True)]
    return np.hstack([np.asarray(pooled, dtype=np.float64), np.asarray(stats, dtype=np.float64)])


def features_with_endings(backend: Backend, samples: Sequence[TrainSample],
                          endings: Sequence[Sequence[TrainSample]], max_tokens: int,
                          known: Rows | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """:func:`features` of ``samples`` and of each one's ``endings`` (the same answer ended earlier,
    an end token after it: exploration's cut answers), ``[len(endings[i]), hidden + 3]`` each.

    An ending whose tokens are the first ones of its answer's costs one position in its answer's pass
    (:meth:`Backend.pooled_endings`) instead of a pass of its own; the others (a tokenizer that splits
    the shorter text differently, a cap that cut the prompt) are encoded as rows, as :func:`features`
    does, and so is every ending on a backend that cannot. ``known``: rows the active model already
    pooled (:mod:`.feature_memo`), read instead of run again; what this pools is added to it."""
    tok = backend.tokenizer
    encoded = [encode_sample(tok, s, max_tokens) for s in samples]
    ended = [[encode_sample(tok, c, max_tokens) for c in cuts] for cuts in endings]
    seen: Mapping[RowKey, list[float]] = {} if known is None else known
    pooled: list[list[float] | None] = [seen.get(row_key(e)) for e in encoded]
    cut_pooled: list[list[list[float] | None]] = [[seen.get(row_key(c)) for c in cuts] for cuts in ended]
    shared: list[list[tuple[int, int]]] = [[] for _ in samples]  # (ending's index, its answer tokens)
    alone: list[tuple[int, int]] = []  # (sample, ending) pairs encoded as rows of their own
    for i, (e, cuts) in enumerate(zip(encoded, ended, strict=True)):
        for j, c in enumerate(cuts):
            if cut_pooled[i][j] is not None:
                continue
            k = c.n_response - 1
            if (c.prompt_len == e.prompt_len and 0 < k <= e.n_response and c.input_ids[-1] == tok.eos_token_id
                    and c.input_ids[:-1] == e.input_ids[:c.length - 1]):
                shared[i].append((j, k))
            else:
                alone.append((i, j))
    # An answer runs when its own row or one of the endings read from its pass is not known yet.
    todo = [i for i in range(len(samples)) if pooled[i] is None or shared[i]]
    groups, batches = backend.batches([encoded[i] for i in todo], EVAL_BATCH_TOKENS)
    for g, batch in zip(([todo[m] for m in grp] for grp in groups), batches, strict=True):
        try:
            own, theirs = backend.pooled_endings(batch, [[k for _, k in shared[i]] for i in g])
        except NotImplementedError:
            own = backend.pooled_hidden(batch)
            theirs = [[] for _ in g]
            alone += [(i, j) for i in g for j, _ in shared[i]]
        for i, row, vectors in zip(g, own, theirs, strict=True):
            pooled[i] = row
            for (j, _), v in zip(shared[i], vectors, strict=False):
                cut_pooled[i][j] = v
    if alone:  # the endings' own encodings, as rows of their own
        for (i, j), row in zip(alone, _pooled(backend, [ended[i][j] for i, j in alone])[0], strict=True):
            cut_pooled[i][j] = row
    if known is not None:
        for e, got in zip(encoded, pooled, strict=True):
            known[row_key(e)] = _present(got)
        for cuts, rows in zip(ended, cut_pooled, strict=True):
            for c, got in zip(cuts, rows, strict=True):
                known[row_key(c)] = _present(got)

    def table(vectors: Sequence[list[float] | None], items: Sequence[TrainSample], enc: Sequence[Encoded]
              ) -> np.ndarray:
        if not items:
            return np.zeros((0, len(_present(pooled[0])) + N_STATISTICS if pooled else N_STATISTICS))
        return _with_statistics([_present(v) for v in vectors], items, enc)

    return (table(pooled, samples, encoded),
            [table(v, cuts, enc) for v, cuts, enc in zip(cut_pooled, endings, ended, strict=True)])


def _present(row: list[float] | None) -> list[float]:
    if row is None:
        raise AssertionError("a row was neither known nor pooled")
    return row


def measure(backend: Backend, samples: Sequence[TrainSample], max_tokens: int, seed: int,
            known: Mapping[RowKey, list[float]] | None = None) -> RewardModelReport:
    """Cross-validate a reward model on ``samples``' ratings under the active model; no forward pass
    when either class is too small to cross-validate. ``known``: answers the active model already
    pooled (:mod:`.feature_memo`), read instead of run again."""
    started = time.perf_counter()
    rated = labelled(samples)
    labels = np.array([1.0 if s.reward > 0 else 0.0 for s in rated])
    refused = why_not(labels)
    model = None
    n_known = 0
    if refused is not None:
        result = CrossValidated(None, refused)
    else:
        try:
            x, n_known = _features(backend, rated, max_tokens, known)
        except NotImplementedError as exc:  # a backend that cannot read this model's hidden states
            result = CrossValidated(None, f"no features: {exc}")
        else:
            result, model = best_of(x, labels, FEATURE_SETS, MAX_FOLDS, seed=seed)
    return RewardModelReport(result.auc, result.reason, time.perf_counter() - started, model, n_known)
