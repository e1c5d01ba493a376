"""The one training loop (worker/training/): the advantage rule in plain numbers, and a learning
signal written once running on both backends through the same loop, on the tiny offline model."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from test_trainer import BAD, GOOD, LEARN, chat, preference_samples

from rlfleet.shared.models import resolve_model
from rlfleet.worker.training.advantages import advantage, asymmetric_advantage, balance_classes, run_advantages
from rlfleet.worker.training.loop import NothingToLearn, RunRequest, Selection, run_training
from rlfleet.worker.training.policy_gradient import PolicyGradient


def test_advantage_rule_is_float32_arithmetic_bit_for_bit():
    # What the tensors of a run hold: r - ema, times pos_weight for liked answers, clamped, in float32.
    rng = random.Random(0)
    for _ in range(2000):
        r = rng.choice([1.0, -1.0, 0.5, -0.25])
        ema, pos_weight, clip = rng.uniform(-1, 1), rng.uniform(0.5, 3), rng.uniform(0.3, 3)
        t = torch.tensor([r], dtype=torch.float32)
        want = torch.where(t > 0, (t - ema) * pos_weight, t - ema).clamp(-clip, clip).item()
        assert advantage(r, ema, pos_weight, clip) == want  # exactly equal, not approximately


def test_run_advantages_keep_retractions_and_seed_a_missing_ema():
    samples = preference_samples()[:2] + [replace(preference_samples()[0], rating_id=99, fixed_advantage=-0.7)]
    assert run_advantages(samples, None, 1.2, 2.0) == pytest.approx([1.2, -1.0, -0.7])
    assert run_advantages(samples, 0.5, 1.2, 2.0) == pytest.approx([0.6, -1.5, -0.7])


def test_asymmetric_rule_is_float32_arithmetic_bit_for_bit():
    # r - (mean - delta); liked answers times pos_weight; a disliked one's in [-neg_bound, 0]; all clamped.
    rng = random.Random(1)
    for _ in range(2000):
        r = rng.choice([1.0, -1.0])
        mean, pos_weight, clip = rng.uniform(-1, 1), rng.uniform(0.5, 3), rng.uniform(0.3, 3)
        delta, neg_bound = rng.uniform(0, 0.5), rng.uniform(0, 2)
        t = torch.tensor([r], dtype=torch.float32)
        raw = t - (torch.tensor(mean, dtype=torch.float32) - torch.tensor(delta, dtype=torch.float32))
        want = torch.where(t > 0, raw.clamp(min=0) * pos_weight, raw.clamp(-neg_bound, 0)).clamp(-clip, clip).item()
        assert asymmetric_advantage(r, mean, pos_weight, clip, delta, neg_bound) == want


def test_asymmetric_advantages_teach_through_the_rare_liked_answers():
    good, bad = preference_samples()[:2]
    assert (good.reward, bad.reward) == (1.0, -1.0)
    samples = [good] + [replace(bad, rating_id=10 + i) for i in range(15)]  # a user who dislikes 15 of 16
    retraction = replace(bad, rating_id=99, fixed_advantage=-0.7)
    adv = run_advantages(samples + [retraction], 0.9, 1.2, 2.0, rule="asymmetric", delta=0.1, neg_bound=0.5)
    mean = (1 - 15) / 16  # the run's own mean reward; the EMA (0.9 here) plays no part
    assert adv[0] == pytest.approx(min((1 - (mean - 0.1)) * 1.2, 2.0))  # the liked answer pulls hard
    assert adv[1:16] == pytest.approx([-1 - (mean - 0.1)] * 15, abs=1e-6)  # each 👎 pushes a little
    assert -0.05 < adv[1] < 0 and adv[-1] == pytest.approx(-0.7)
    everyone_bad = run_advantages(samples[1:], None, 1.2, 2.0, rule="asymmetric", delta=0.1, neg_bound=0.5)
    assert everyone_bad == [0.0] * 15  # a 👎 never pushes its answer up, even below the baseline
    mostly_good = run_advantages([replace(good, rating_id=20 + i) for i in range(15)] + [bad], None, 1.2, 2.0,
                                 rule="asymmetric", delta=0.1, neg_bound=0.5)
    assert mostly_good[-1] == pytest.approx(-0.5)  # bounded: the rare 👎 of a happy user
    assert run_advantages(samples, None, 1.2, 2.0) == run_advantages(samples, None, 1.2, 2.0, rule="ema")


def test_balanced_classes_weight_the_rarer_sign_up_to_the_cap():
    # A user who likes 2 answers of 32: the two pull as hard in total as the thirty push.
    adv = [1.5, 1.5] + [-0.75] * 30 + [-0.7]  # the last one a retraction: never rescaled
    rated = [True] * 32 + [False]
    got, factor = balance_classes(adv, rated, cap=16)
    assert factor == pytest.approx(7.5)
    assert got[:2] == pytest.approx([11.25, 11.25]) and got[2:] == adv[2:]
    assert sum(a for a in got[:32] if a > 0) == pytest.approx(-sum(a for a in got[:32] if a < 0))
    assert balance_classes(adv, rated, cap=4) == ([6.0, 6.0] + adv[2:], 4.0)  # capped
    # A happy user's rare 👎 is the one weighted up; one sign alone, or the cap at 1 or 0, changes nothing.
    happy, happy_factor = balance_classes([1.0] * 6 + [-1.5], [True] * 7, cap=16)
    assert happy_factor == 4.0 and happy == [1.0] * 6 + [-6.0]
    assert balance_classes([-1.0] * 5, [True] * 5, cap=16) == ([-1.0] * 5, 1.0)
    assert balance_classes(adv, rated, cap=1.0) == (adv, 1.0) == balance_classes(adv, rated, cap=0.0)


def test_the_advantage_rule_needs_no_tensor_framework():
    blocked = "import sys; sys.modules['torch'] = None; sys.modules['mlx'] = None; "
    code = blocked + "import rlfleet.worker.training.advantages as a; print(a.advantage(1.0, 0.5, 1.2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(0.6)


class LikedOnly(PolicyGradient):
    """A new learning signal, written once: liked answers only, each with advantage 1, and the final
    KL left to the loop (measured on the saved adapter)."""

    def select(self, backend, samples, ema, cfg) -> Selection:
        liked = [s for s in samples if s.reward > 0]
        return Selection(liked, [1.0] * len(liked), 1.0)

    @contextlib.contextmanager
    def train(self, backend, session, data, cfg, report):
        with super().train(backend, session, data, cfg, report) as outcome:
            yield replace(outcome, final_kl=None, extra={"in_session_kl": outcome.final_kl})


@pytest.fixture(scope="module", params=["torch", "mlx"])
def backend(request, tiny_trainer, tiny_model_dir):
    if request.param == "torch":
        return tiny_trainer
    pytest.importorskip("mlx.core", exc_type=ImportError, reason="the MLX backend needs mlx: pip install -e '.[mlx]'")
    pytest.importorskip("mlx_lm", exc_type=ImportError, reason="the MLX backend needs mlx-lm: pip install -e '.[mlx]'")
    from rlfleet.worker.training.mlx_backend import MlxTrainer

    return MlxTrainer(resolve_model(str(tiny_model_dir)))


def test_a_new_signal_runs_on_every_backend_through_the_same_loop(backend, tmp_path):
    samples = preference_samples()[:8]
    seen = []
    run = RunRequest(samples, None, replace(LEARN, steps=2), None, tmp_path / "a", progress=seen.append)
    result = run_training(backend, LikedOnly(), run)
    assert result.advantages == {0: 1.0, 2: 1.0, 4: 1.0, 6: 1.0}  # only the liked answers trained
    assert result.metrics["ratings_used"] == 8 and result.metrics["n_tokens"] > 0
    assert result.promoted_ok and result.reason is None
    assert [p.phase for p in seen][0] == "reference" and seen[-1].phase == "saving"
    # The loop's measurement of the saved adapter agrees with the one the steps took in session.
    assert result.metrics["final_mean_kl"] == pytest.approx(result.metrics["in_session_kl"], abs=1e-5)
    assert result.metrics["final_mean_kl"] > 0
    liked = [(chat("Describe snow briefly."), GOOD)]
    assert backend.mean_logprobs(liked, tmp_path / "a")[0] > backend.mean_logprobs(liked)[0]


def test_balanced_classes_pull_a_rare_liked_answer_up_further_on_every_backend(backend, tmp_path):
    # One liked answer among seven disliked ones: weighted up, it rises more than under the plain rule.
    samples = preference_samples()
    rated = [samples[0]] + [s for s in samples if s.reward < 0][:7]
    liked = [(rated[0].prompt, GOOD)]
    cfg = replace(LEARN, steps=3, balance=0.0)
    plain = run_training(backend, PolicyGradient(), RunRequest(rated, None, cfg, None, tmp_path / "plain"))
    weighted = run_training(backend, PolicyGradient(), RunRequest(rated, None, replace(cfg, balance=16.0), None,
                                                                  tmp_path / "balanced"))
    assert "class_weight" not in plain.metrics
    assert weighted.metrics["class_weight"] == pytest.approx(7 * 1.0 / 1.2)  # 7 pushes of 1.0, one pull of 1.2
    assert weighted.advantages[0] == pytest.approx(7.0) and weighted.advantages[1] == plain.advantages[1]
    base = backend.mean_logprobs(liked)[0]
    rise_plain = backend.mean_logprobs(liked, tmp_path / "plain")[0] - base
    rise_weighted = backend.mean_logprobs(liked, tmp_path / "balanced")[0] - base
    assert rise_weighted > rise_plain > 0


def test_a_faded_dislike_stops_pushing_its_answer_down_on_every_backend(backend, tmp_path):
    # Only 👎s, pushed for many steps with no anchor and no bands: with the fade their push stops once
    # the answers are below the base's; without it, it goes on.
    bad = [s for s in preference_samples() if s.reward < 0][:6]
    disliked = [(s.prompt, BAD) for s in bad]
    cfg = replace(LEARN, steps=8, beta=0.0, unlikelihood=0.0, seq_band=(0.01, 100.0), token_band=(0.01, 100.0),
                  neg_fade=0.0)
    run_training(backend, PolicyGradient(), RunRequest(bad, None, cfg, None, tmp_path / "plain"))
    run_training(backend, PolicyGradient(), RunRequest(bad, None, replace(cfg, neg_fade=0.02), None,
                                                       tmp_path / "faded"))

    def fall(adapter):
        return sum(backend.mean_logprobs(disliked)) / 6 - sum(backend.mean_logprobs(disliked, adapter)) / 6

    plain, faded = fall(tmp_path / "plain"), fall(tmp_path / "faded")
    # The optimizer's momentum carries the push on for a few steps after it fades, so the answer still
    # falls some way past tau: but clearly less far.
    assert 0 < faded < 0.75 * plain


def test_a_run_with_nothing_to_learn_trains_and_saves_nothing(backend, tmp_path):
    bad = [s for s in preference_samples() if s.reward < 0][:4]
    cfg = replace(LEARN, steps=2, advantage="asymmetric")
    with pytest.raises(NothingToLearn, match="nothing to learn from these 4 ratings yet, none of them liked"):
        run_training(backend, PolicyGradient(), RunRequest(bad, None, cfg, None, tmp_path / "a"))
    assert not (tmp_path / "a").exists()
