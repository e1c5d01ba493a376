"""The user's reward model in plain numbers: an L2-regularised logistic regression on the features of
rated answers, and how well it ranks answers it was not fitted on (cross-validated AUC).

Pure numpy, no tensor framework: the features come in as a ``[n, d]`` array (:mod:`.reward_features`
computes them from a backend), the labels as 1 (liked) / 0 (disliked). Everything here is
deterministic: Newton steps from zero, folds drawn from a seeded generator.

A run has tens of ratings and features as wide as the model's hidden size, so the fit works in the
span of the training rows: with ``w = V z`` (``V`` the right singular vectors of the standardised
rows) the penalised problem in ``z`` has the same optimum as the one in ``w`` (the gradient of the
data term always lies in that span) and at most ``n`` unknowns, so a Newton step solves an
``n x n`` system whatever the hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

Array = NDArray[np.float64]

L2 = 10.0  # the penalty on the squared weights of standardised features (the intercept is free)
MAX_FOLDS = 5
MIN_PER_CLASS = 2  # fewer liked (or disliked) answers than this: no cross-validation is possible
NEWTON_STEPS = 50
_TOLERANCE = 1e-8  # a Newton step this small (in every coordinate) has converged
_FLOOR = 1e-12  # a feature whose spread over the training rows is below this is left unscaled


@dataclass(frozen=True)
class Standardiser:
    """Per-feature centre and scale, taken from the rows a model is fitted on."""

    mean: Array
    scale: Array

    @classmethod
    def of(cls, features: Array) -> Standardiser:
        std = features.std(axis=0)
        return cls(features.mean(axis=0), np.where(std > _FLOOR, std, 1.0))

    def __call__(self, features: Array) -> Array:
        return (features - self.mean) / self.scale


@dataclass(frozen=True)
class RewardModel:
    """A fitted model: ``score`` is the log-odds that the user likes an answer with these features."""

    standardiser: Standardiser
    weights: Array
    bias: float
    columns: slice | None = None  # the feature columns it was fitted on (:func:`best_of`); None: all

    def score(self, features: ArrayLike) -> Array:
        x = _matrix(features)
        return self.standardiser(x if self.columns is None else x[:, self.columns]) @ self.weights + self.bias


@dataclass(frozen=True)
class CrossValidated:
    """A cross-validated AUC, or None with the reason; ``reason`` also says what it was measured on."""

    auc: float | None
    reason: str
    folds: int = 0


def fit(features: ArrayLike, labels: ArrayLike, l2: float = L2) -> RewardModel:
    """Minimise ``sum_i logloss(y_i, x_i . w + b) + l2 / 2 * |w|^2`` over standardised features by
    Newton's method with backtracking (the objective is strictly convex in ``w``)."""
    x, y = _matrix(features), _labels(labels)
    if len(x) != len(y) or len(y) == 0:
        raise ValueError(f"{len(x)} feature rows for {len(y)} labels")
    standardiser = Standardiser.of(x)
    z = standardiser(x)
    # The span of the rows: U S V^T with the near-null directions dropped (they carry no data).
    _, s, vt = np.linalg.svd(z, full_matrices=False)
    keep = s > _FLOOR * max(float(s[0]) if s.size else 0.0, 1.0)
    basis = vt[keep].T  # [d, r]
    reduced = np.hstack([z @ basis, np.ones((len(y), 1))])  # the last column is the intercept's
    penalty = np.full(reduced.shape[1], l2)
    penalty[-1] = 0.0
    theta = _newton(reduced, y, penalty)
    return RewardModel(standardiser, basis @ theta[:-1], float(theta[-1]))


def _newton(x: Array, y: Array, penalty: Array) -> Array:
    theta = np.zeros(x.shape[1])
    loss = _objective(x, y, penalty, theta)
    for _ in range(NEWTON_STEPS):
        p = _sigmoid(x @ theta)
        grad = x.T @ (p - y) + penalty * theta
        w = p * (1.0 - p)
        # The tiny ridge keeps the intercept's row solvable once every answer is fitted with certainty.
        hessian = (x * w[:, None]).T @ x + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hessian, grad)
        t = 1.0
        while True:  # backtracking: a full Newton step can overshoot far from the optimum
            candidate = theta - t * step
            new_loss = _objective(x, y, penalty, candidate)
            if new_loss <= loss or t < 1e-6:
                break
            t /= 2
        theta, loss = candidate, new_loss
        if np.max(np.abs(t * step)) < _TOLERANCE:
            break
    return theta


def _objective(x: Array, y: Array, penalty: Array, theta: Array) -> float:
    m = x @ theta
    # logloss = log(1 + e^m) - y m, computed without overflow
    return float(np.sum(np.logaddexp(0.0, m) - y * m) + 0.5 * np.sum(penalty * theta * theta))


def _sigmoid(m: Array) -> Array:
    return np.exp(-np.logaddexp(0.0, -m))


def auc(scores: ArrayLike, labels: ArrayLike) -> float:
    """The share of (liked, disliked) pairs the scores order correctly, a tie counting 1/2 (the
    Mann-Whitney U over ``n_liked * n_disliked``); both classes must be present."""
    s, y = np.asarray(scores, dtype=np.float64).ravel(), _labels(labels)
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    if len(s) != len(y) or n_pos == 0 or n_neg == 0:
        raise ValueError(f"an AUC needs both classes: {n_pos} liked, {n_neg} disliked of {len(s)} scores")
    # Average ranks (1-based), tied scores sharing the mean of their positions.
    values, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # 0-based position of each distinct value's first occurrence
    ranks = (first + (counts + 1) / 2.0)[inverse]
    u = ranks[y == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def stratified_folds(labels: ArrayLike, k: int, seed: int) -> list[NDArray[np.int64]]:
    """``k`` folds of row indices, each class shuffled by ``seed`` and dealt round-robin, so every
    fold holds at least one of each class when ``k`` is at most the smaller class's size."""
    y = _labels(labels)
    rng = np.random.default_rng(seed)
    order = np.concatenate([rng.permutation(np.flatnonzero(y == c)) for c in (1.0, 0.0)])
    fold_of = np.empty(len(y), dtype=np.int64)
    fold_of[order] = np.arange(len(y)) % k
    return [np.flatnonzero(fold_of == f) for f in range(k)]


def cross_validated_auc(
    features: ArrayLike, labels: ArrayLike, folds: int = MAX_FOLDS, l2: float = L2, seed: int = 0
) -> CrossValidated:
    """The AUC of out-of-fold scores: stratified k-fold with ``k = min(folds, size of the smaller
    class)``, each fold scored by a model fitted (standardisation included) on the others, the
    scores pooled into one AUC (per-fold AUCs on a handful of answers would each be coarse).
    None when either class has fewer than two answers."""
    x, y = _matrix(features), _labels(labels)
    refused = why_not(y)
    if refused is not None:
        return CrossValidated(None, refused)
    n_pos, n_neg = int(y.sum()), int(len(y) - y.sum())
    k = min(folds, n_pos, n_neg)
    scores = np.empty(len(y))
    for held in stratified_folds(y, k, seed):
        train = np.setdiff1d(np.arange(len(y)), held)
        scores[held] = fit(x[train], y[train], l2).score(x[held])
    return CrossValidated(auc(scores, y), f"{k}-fold cross-validated on {_counts(y)}", k)


def why_not(labels: ArrayLike) -> str | None:
    """Why these labels cannot be cross-validated (either class under two answers), or None."""
    y = _labels(labels)
    if min(y.sum(), len(y) - y.sum()) < MIN_PER_CLASS:
        return f"too few rated answers of one class to cross-validate ({_counts(y)})"
    return None


def _counts(y: Array) -> str:
    return f"{int(y.sum())} liked, {int(len(y) - y.sum())} disliked"


def _matrix(features: ArrayLike) -> Array:
    x = np.asarray(features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must be rows of numbers, not an array of shape {x.shape}")
    return x


def _labels(labels: ArrayLike | Sequence[float]) -> Array:
    y = np.asarray(labels, dtype=np.float64).ravel()
    if not np.all((y == 0) | (y == 1)):
        raise ValueError("labels must be 1 (liked) or 0 (disliked)")
    return y


def best_of(features: ArrayLike, labels: ArrayLike, feature_sets: dict[str, slice], folds: int = MAX_FOLDS,
            l2: float = L2, seed: int = 0) -> tuple[CrossValidated, RewardModel | None]:
    """Cross-validate a model on each named set of feature columns and keep the best (the first of
    equals): with a handful of liked answers, hundreds of hidden-state features can drown the one
    plain statistic a taste hangs on, and a few columns can miss what only the hidden state shows.
    Returns its AUC (the reason naming the set) and the model fitted on every row with its columns,
    or the last refusal and None when no set could be cross-validated."""
    x = _matrix(features)
    best: tuple[str, CrossValidated, slice] | None = None
    last = CrossValidated(None, "no feature sets")
    for name, columns in feature_sets.items():
        last = cross_validated_auc(x[:, columns], labels, folds, l2, seed)
        if last.auc is not None and (best is None or last.auc > (best[1].auc or 0.0)):
            best = (name, last, columns)
    if best is None:
        return last, None
    name, cv, columns = best
    fitted = fit(x[:, columns], labels, l2)
    return CrossValidated(cv.auc, f"{cv.reason}, on {name}", cv.folds), replace(fitted, columns=columns)
