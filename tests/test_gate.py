"""The gate's pure parts: the held-out split, the margin and its noise, collapse signals, verdicts."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rlfleet.worker.gate import (
    GateConfig,
    ModelScores,
    TowardHints,
    distinct_n,
    judge,
    margin,
    paired_noise,
    repeated_ngrams,
    sample_plan,
    split_holdout,
)

CFG = GateConfig()


def test_split_holds_out_the_newest_of_each_class():
    items = list(range(32))
    rewards = [1.0 if i % 4 else -1.0 for i in items]  # 24 good, 8 bad
    train, held = split_holdout(items, rewards, 0.15, 4)
    assert len(held) == 5 and sorted(train + held) == items
    good = [i for i in held if rewards[i] > 0]
    bad = [i for i in held if rewards[i] < 0]
    assert len(good) == 4 and len(bad) == 1
    assert good == [27, 29, 30, 31] and bad == [28]  # the newest of each class


def test_split_keeps_a_minimum_and_skips_tiny_runs():
    assert split_holdout(list(range(7)), [1.0] * 7, 0.15, 4) == (list(range(7)), [])
    train, held = split_holdout(list(range(10)), [1.0, -1.0] * 5, 0.15, 4)
    assert len(held) == 4 and len(train) == 6
    assert sum(1 for i in held if i % 2 == 0) == 2  # balanced classes split evenly


def test_split_represents_a_rare_class():
    rewards = [1.0] * 30 + [-1.0] * 2
    _, held = split_holdout(list(range(32)), rewards, 0.15, 4)
    assert any(rewards[i] < 0 for i in held)


def test_margin_and_noise_by_hand():
    assert margin([-1.0, -3.0, -2.0], [1, -1, -1]) == pytest.approx(-1.0 - (-2.5))
    assert margin([-1.0, -2.0], [1, 1]) == pytest.approx(-1.5)  # no bad answers: good side alone
    assert margin([-1.0, -2.0], [-1, -1]) == pytest.approx(1.5)
    # good changes 0.1, 0.3 (mean 0.2); bad -0.2, 0.0 (mean -0.1): squared deviations 0.01 each,
    # pooled variance 0.04 / 2 = 0.02; SE = sqrt(0.02 * (1/2 + 1/2)) = 0.1414
    assert paired_noise([0.1, 0.3, -0.2, 0.0], [0.0] * 4, [1, 1, -1, -1]) == pytest.approx(math.sqrt(0.02))
    assert math.isinf(paired_noise([0.1, 0.2], [0.0, 0.0], [1, -1]))  # one answer per class: no spread


def test_repeated_ngrams_and_the_sampling_plan():
    assert repeated_ngrams([1, 2, 3, 4, 5]) == 0.0
    # "my dear , my dear , my dear !": 7 trigrams, 3 of them seen before
    assert repeated_ngrams(["my", "dear", ",", "my", "dear", ",", "my", "dear", "!"]) == pytest.approx(3 / 7)
    assert repeated_ngrams([1, 2]) == 0.0
    assert sample_plan(["a", "b", "c"], 8) == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert sample_plan([], 8) == [] and sample_plan(["a"], 0) == []


def test_scores_from_sums_measure_repetition_per_answer():
    looping = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # 7 trigrams, 3 distinct
    s = ModelScores.from_sums([-1.0], [2.0], [0.0], [1], [looping, [4, 5, 6, 7]])
    assert s.repetition == pytest.approx((4 / 7 + 0.0) / 2)
    assert ModelScores.from_sums([-1.0], [2.0], [0.0], [1], None).repetition is None


def test_a_blurred_or_looping_candidate_is_refused_even_when_its_margin_rises():
    """What the 128-rating benchmark served before these checks: margin up, distinct bigrams at
    0.7x (passing the collapse check), entropy 1.39x, answers repeating phrases."""
    cand = _scores([-1.6, -1.7, -2.5, -2.6], entropy=2.78, distinct=0.63, repetition=0.15)
    v = judge(REWARDS, BASE, BASE, cand, CFG)
    assert v.metrics["heldout_margin_after"] > v.metrics["heldout_margin_before"]
    assert not v.promote and "entropy" in v.reason and "trigrams" in v.reason
    assert v.metrics["repetition"] == 0.15 and v.metrics["repetition_base"] == 0.02
    # the same figures a little under the bounds pass
    assert judge(REWARDS, BASE, BASE, replace(cand, entropy=2.5, repetition=0.045, distinct2=0.82), CFG).promote


def test_a_candidate_whose_answers_say_fewer_different_things_than_the_bases_is_refused():
    """Distinct bigrams at 0.88x the base's with repetition under the base's: the direct taste's second
    run on the CPU, which the benchmark then measured at 0.81x on 64 answers."""
    good = _scores([-1.6, -1.7, -2.5, -2.6], repetition=0.01)
    assert judge(REWARDS, BASE, BASE, replace(good, distinct2=0.9 * 0.88), CFG).reason == (
        "collapse: distinct bigrams 0.88x the base's")
    assert judge(REWARDS, BASE, BASE, replace(good, distinct2=0.9 * 0.92), CFG).promote


def test_distinct_n():
    assert distinct_n([[1, 2, 3, 4]]) == 1.0
    assert distinct_n([[7, 7, 7, 7, 7]]) == pytest.approx(1 / 4)
    assert distinct_n([[1], []]) == 1.0


def _scores(lps, kl=0.01, entropy=2.0, distinct=0.9, length=30.0, repetition=0.02):
    return ModelScores(logprobs=lps, kl=kl, entropy=entropy, distinct2=distinct, answer_tokens=length,
                       repetition=repetition)


REWARDS = [1, 1, -1, -1]
BASE = _scores([-2.0, -2.1, -2.0, -2.2], kl=0.0)


def test_a_better_candidate_is_promoted():
    cand = _scores([-1.6, -1.7, -2.5, -2.6])
    v = judge(REWARDS, BASE, BASE, cand, CFG)
    assert v.promote and v.reason is None and v.metrics["verdict"] == "promoted"
    assert v.metrics["heldout_margin_after"] > v.metrics["heldout_margin_before"]


def test_a_slightly_worse_candidate_within_noise_passes():
    cand = _scores([-2.01, -2.11, -2.0, -2.2])  # margin 0.05 -> 0.04, within the 0.02 floor
    assert judge(REWARDS, BASE, BASE, cand, CFG).promote


def test_inverted_preferences_are_rejected():
    cand = _scores([-2.6, -2.7, -1.5, -1.6])
    v = judge(REWARDS, BASE, BASE, cand, CFG)
    assert not v.promote and "margin fell" in v.reason and v.metrics["verdict"] == "rejected"


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"kl": 0.9}, "KL to the base"),
        ({"entropy": 0.3}, "entropy"),
        ({"entropy": 2.8}, "degenerating: next-token entropy 1.40x"),
        ({"repetition": 0.2}, "repeat 20% of their trigrams"),
        ({"distinct": 0.2}, "distinct bigrams"),
        ({"length": 1.0}, "shrank"),
        ({"kl": float("nan")}, "non-finite"),
    ],
)
def test_drift_and_collapse_are_rejected(change, fragment):
    good = dict(lps=[-1.6, -1.7, -2.5, -2.6])
    v = judge(REWARDS, BASE, BASE, _scores(**good, **change), CFG)
    assert not v.promote and fragment in v.reason


def test_short_answers_are_not_collapse_when_the_base_is_short_too():
    base = replace(BASE, answer_tokens=5.0)
    cand = _scores([-1.6, -1.7, -2.5, -2.6], length=1.5)
    assert judge(REWARDS, base, base, cand, CFG).promote


def test_one_class_held_out_gets_the_lower_kl_cap():
    """All held-out answers bad: lowering every likelihood raises the one-sided margin, so drift that
    passes with both classes held out is refused here."""
    bad_only = [-1, -1, -1, -1]
    drifted = _scores([-2.6, -2.7, -2.6, -2.8], kl=0.3)  # every answer less likely: "margin" up
    v = judge(bad_only, BASE, BASE, drifted, CFG)
    assert v.metrics["heldout_margin_after"] > v.metrics["heldout_margin_before"]
    assert not v.promote and "only bad answers held out" in v.reason and v.metrics["heldout_one_class"]
    assert judge(bad_only, BASE, BASE, replace(drifted, kl=0.05), CFG).promote  # a small step is fine
    assert judge(REWARDS, BASE, BASE, _scores([-1.6, -1.7, -2.5, -2.6], kl=0.3), CFG).promote  # two classes


def test_words_on_one_class_held_out_answers_lift_the_cap_for_a_candidate_nearer_their_teacher():
    """The held-out 👎s came with words: a candidate whose distributions on them came closer to the
    teacher reading the words, beyond the paired noise, is held to the usual cap; one that moved
    away, or by less than the noise, or judged on a single answer with words, keeps the low cap."""
    bad_only = [-1, -1, -1, -1]
    drifted = _scores([-2.6, -2.7, -2.6, -2.8], kl=0.3)
    before = [0.50, 0.60, 0.55, 0.45]
    closer = TowardHints(before, [0.30, 0.42, 0.31, 0.27])
    v = judge(bad_only, BASE, BASE, drifted, CFG, closer)
    assert v.promote, v
    assert v.metrics["heldout_toward_teacher"] and v.metrics["heldout_hinted"] == 4
    assert v.metrics["heldout_teacher_div_after"] < v.metrics["heldout_teacher_div_before"]
    for hints in (TowardHints(before, [0.70, 0.80, 0.75, 0.65]),  # away from the teacher
                  TowardHints(before, [0.49, 0.59, 0.54, 0.44]),  # closer by less than min_noise
                  TowardHints(before, [0.20, 0.70, 0.10, 0.60]),  # closer on average, within the noise
                  TowardHints(before[:1], [0.1])):  # one answer: no noise to judge by
        v = judge(bad_only, BASE, BASE, drifted, CFG, hints)
        assert not v.promote and "only bad answers held out" in v.reason, (hints, v)
    assert not judge(bad_only, BASE, BASE, replace(drifted, kl=0.9), CFG, closer).promote  # the usual cap holds
    entropic = replace(drifted, entropy=2.8)  # the other checks still apply
    assert "degenerating" in judge(bad_only, BASE, BASE, entropic, CFG, closer).reason


def test_the_gate_samples_the_way_the_chat_answers():
    """Its repetition check reads answers drawn at the chat's temperature and top-p: the answers
    users get."""
    from rlfleet.shared.config import ChatSettings, Config
    from rlfleet.worker.orchestrate import gate_config

    assert (CFG.eval_temperature, CFG.eval_top_p) == (ChatSettings().temperature, ChatSettings().top_p)
    g = gate_config(Config(chat=ChatSettings(temperature=0.3, top_p=0.5)))
    assert (g.eval_temperature, g.eval_top_p) == (0.3, 0.5)
