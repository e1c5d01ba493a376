"""The user's reward model (worker/training/reward_model.py, reward_features.py): the fit and its
cross-validated AUC on synthetic numbers, the features a backend gives, and what a run reports."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from test_trainer import LEARN, preference_samples

from rlfleet.shared.models import resolve_model
from rlfleet.worker.training import reward_features
from rlfleet.worker.training.reward_model import auc, best_of, cross_validated_auc, fit, stratified_folds, why_not


def _synthetic(n: int, d: int, shift: float, seed: int, liked_share: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = (np.arange(n) < round(n * liked_share)).astype(float)
    x = rng.normal(size=(n, d))
    x[:, 0] += shift * y  # only the first feature says anything about the label
    return x, y


# ---- AUC -----------------------------------------------------------------------------------------


def test_auc_of_a_known_small_case_and_ties_count_half():
    # Pairs (liked, disliked): (0.35, 0.1) right, (0.35, 0.4) wrong, (0.8, *) both right: 3 of 4.
    assert auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == 0.75
    assert auc([1, 1, 2], [0, 1, 1]) == 0.75  # (1 vs 1) a tie: 1/2, (2 vs 1) right: 1
    assert auc([3, 3, 3, 3], [1, 0, 1, 0]) == 0.5
    assert auc([0, 1, 2, 3], [1, 1, 0, 0]) == 0.0


def test_auc_agrees_with_counting_every_pair():
    rng = np.random.default_rng(0)
    for _ in range(50):
        s = rng.integers(0, 5, size=12).astype(float)  # many ties
        y = np.array([1, 0] * 6)
        rng.shuffle(y)
        pairs = list(itertools.product(s[y == 1], s[y == 0]))
        want = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs) / len(pairs)
        assert auc(s, y) == pytest.approx(want, abs=1e-12)


def test_auc_needs_both_classes_and_binary_labels():
    with pytest.raises(ValueError, match="both classes"):
        auc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="1 \\(liked\\) or 0"):
        auc([0.1, 0.2], [1, -1])


# ---- the fit -------------------------------------------------------------------------------------


def test_the_fit_is_the_penalised_optimum_and_works_in_the_rows_span():
    x, y = _synthetic(30, 200, 2.0, seed=1)  # wider than tall, as hidden states of a run are
    model = fit(x, y, l2=3.0)
    z = model.standardiser(x)
    p = 1 / (1 + np.exp(-(z @ model.weights + model.bias)))
    # Stationary: the penalised gradient vanishes for the weights and for the free intercept.
    assert np.abs(z.T @ (p - y) + 3.0 * model.weights).max() < 1e-6
    assert abs(float((p - y).sum())) < 1e-6
    assert model.score(x).shape == (30,)


def test_constant_features_do_no_harm():
    x, y = _synthetic(20, 3, 3.0, seed=2)
    x = np.hstack([x, np.ones((20, 2))])
    assert np.isfinite(fit(x, y).score(x)).all()


# ---- cross-validation ----------------------------------------------------------------------------


def test_separable_data_cross_validates_near_one_and_random_labels_near_a_half():
    x, y = _synthetic(60, 5, 8.0, seed=3)
    assert cross_validated_auc(x, y).auc > 0.97
    aucs = []
    for seed in range(20):
        x, y = _synthetic(60, 20, 0.0, seed=seed)
        result = cross_validated_auc(x, y, seed=seed)
        assert result.auc is not None
        aucs.append(result.auc)
    assert abs(np.mean(aucs) - 0.5) < 0.06


def test_a_few_liked_answers_are_ranked_by_the_feature_set_that_cross_validates_best():
    # 3 liked answers among 30, told apart by the last column (the length, say); 576 noise columns
    # beside it, as a hidden state that says nothing about this taste.
    rng = np.random.default_rng(0)
    y = (np.arange(30) < 3).astype(float)
    x = np.hstack([rng.normal(size=(30, 576)), (np.where(y > 0, 2.5, 4.0) + rng.normal(0, 0.2, 30))[:, None]])
    sets = {"statistics": slice(-1, None), "everything": slice(None)}
    alone = cross_validated_auc(x, y).auc
    cv, model = best_of(x, y, sets)
    assert cv.auc is not None and alone is not None and cv.auc > 0.95 > alone  # the wide set drowns it
    assert cv.reason.endswith("on statistics") and model is not None and model.columns == slice(-1, None)
    scores = model.score(x)  # the full rows: the model picks its own columns
    assert scores[:3].min() > scores[3:].max()
    one_class, none = best_of(x, np.zeros(30), sets)
    assert one_class.auc is None and none is None


def test_folds_are_stratified_and_deterministic():
    y = np.array([1] * 3 + [0] * 10, dtype=float)
    folds = stratified_folds(y, 3, seed=7)
    assert sorted(np.concatenate(folds).tolist()) == list(range(13))
    assert all(y[f].sum() >= 1 and (1 - y[f]).sum() >= 1 for f in folds)
    assert [f.tolist() for f in folds] == [f.tolist() for f in stratified_folds(y, 3, seed=7)]
    assert [f.tolist() for f in folds] != [f.tolist() for f in stratified_folds(y, 3, seed=8)]


def test_cross_validation_is_deterministic_and_uses_at_most_the_smaller_class_in_folds():
    x, y = _synthetic(40, 30, 1.0, seed=4, liked_share=0.1)  # 4 liked
    a, b = cross_validated_auc(x, y, seed=5), cross_validated_auc(x, y, seed=5)
    assert a == b and a.folds == 4 and a.reason == "4-fold cross-validated on 4 liked, 36 disliked"
    assert cross_validated_auc(*_synthetic(40, 30, 1.0, seed=4, liked_share=0.5)).folds == 5


def test_no_auc_with_fewer_than_two_answers_of_a_class():
    x, y = _synthetic(10, 3, 1.0, seed=6, liked_share=0.1)  # one liked answer
    result = cross_validated_auc(x, y)
    assert result.auc is None and result.reason == why_not(y)
    assert "1 liked, 9 disliked" in result.reason
    assert why_not(np.array([1, 1, 0, 0])) is None


def test_answer_statistics():
    assert reward_features.answer_statistics("Yes. It snows! Why?", 7) == pytest.approx([np.log(7), np.log(5), 0.75])
    assert reward_features.answer_statistics("a b c d.", 5)[2] == 0.25
    assert reward_features.answer_statistics("", 1) == [0.0, 0.0, 0.0]
    # Answers cut at the same token cap: the words still tell the long one from the short one.
    stats = reward_features.answer_statistics
    long, short = stats("a " * 40, 48), stats("antidisestablishment " * 6, 48)
    assert long[0] == short[0] and long[1] > short[1]


def test_the_reward_model_needs_no_tensor_framework():
    blocked = "import sys; sys.modules['torch'] = None; sys.modules['mlx'] = None; "
    code = blocked + "import rlfleet.worker.training.reward_model as m; print(m.auc([0, 1], [0, 1]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 1.0


# ---- on the backends -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_trainer(tiny_model_dir):
    pytest.importorskip("mlx.core", exc_type=ImportError, reason="the MLX backend needs mlx: pip install -e '.[mlx]'")
    pytest.importorskip("mlx_lm", exc_type=ImportError, reason="the MLX backend needs mlx-lm: pip install -e '.[mlx]'")
    from rlfleet.worker.training.mlx_backend import MlxTrainer

    return MlxTrainer(resolve_model(str(tiny_model_dir)))


def test_both_backends_pool_the_same_hidden_states(tiny_trainer, mlx_trainer):
    samples = preference_samples()[:6]
    torch_x = reward_features.features(tiny_trainer, samples, 96)
    mlx_x = reward_features.features(mlx_trainer, samples, 96)
    hidden = tiny_trainer.base.config.hidden_size
    assert torch_x.shape == (6, hidden + reward_features.N_STATISTICS)
    assert np.abs(torch_x - mlx_x).max() < 1e-3
    # A batch's padding (longer neighbours) changes nothing.
    alone = reward_features.features(tiny_trainer, samples[:1], 96)
    assert np.abs(alone - torch_x[:1]).max() < 1e-4


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_a_run_reports_the_reward_models_auc(backend_name, tiny_trainer, request, tmp_path):
    from rlfleet.worker.training.loop import RunRequest, run_training
    from rlfleet.worker.training.policy_gradient import PolicyGradient

    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    samples = preference_samples()[:8]  # 4 liked, 4 disliked
    assert sorted(s.reward for s in samples) == [-1.0] * 4 + [1.0] * 4
    cfg = replace(LEARN, steps=1)
    both = run_training(backend, PolicyGradient(), RunRequest(samples, None, cfg, None, tmp_path / "a")).metrics
    assert both["reward_model_auc"] == 1.0  # every liked answer says "yes", every disliked one "no"
    assert both["reward_model_reason"].startswith("4-fold cross-validated on 4 liked, 4 disliked, on ")
    assert both["reward_model_reason"].rsplit(", on ", 1)[1] in reward_features.FEATURE_SETS
    assert 0 < both["reward_model_seconds"] < both["seconds"]

    # One liked answer (a retraction of a liked one has no label): no AUC, and why.
    retraction = replace(samples[0], rating_id=99, fixed_advantage=-0.5)
    one = [samples[0], *[s for s in samples if s.reward < 0], retraction]
    metrics = run_training(backend, PolicyGradient(), RunRequest(one, None, cfg, None, tmp_path / "b")).metrics
    assert metrics["reward_model_auc"] is None
    assert metrics["reward_model_reason"] == (
        "too few rated answers of one class to cross-validate (1 liked, 4 disliked)")


def test_the_reward_model_leaves_training_as_it_was(tiny_trainer, tmp_path, monkeypatch):
    from safetensors.numpy import load_file

    from rlfleet.shared.registry import ADAPTER_WEIGHTS
    from rlfleet.worker.training.loop import RunRequest, run_training
    from rlfleet.worker.training.policy_gradient import PolicyGradient

    samples, cfg = preference_samples()[:8], replace(LEARN, steps=2)
    run_training(tiny_trainer, PolicyGradient(), RunRequest(samples, None, cfg, None, tmp_path / "with"))
    skipped = reward_features.RewardModelReport(None, "skipped", 0.0)
    monkeypatch.setattr(reward_features, "measure", lambda *_a: skipped)
    run_training(tiny_trainer, PolicyGradient(), RunRequest(samples, None, cfg, None, tmp_path / "without"))
    a, b = (load_file(str(tmp_path / d / ADAPTER_WEIGHTS)) for d in ("with", "without"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
