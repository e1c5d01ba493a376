"""A rating's reward from its thumb and stars (worker/training/rewards.py), and as a run reads it."""

from __future__ import annotations

import pytest

from rlfleet.worker.training.rewards import STAR_WEIGHT, rating_reward, star_centre, star_centres


def test_a_thumb_alone_is_plus_or_minus_one_and_stars_refine_it_within_its_sign():
    assert rating_reward(1, None) == 1.0 and rating_reward(-1, None) == -1.0
    # Someone new to stars: a 👍 in 4 or 5 stars is worth more than a bare 👍, a 👎 in 1 star less.
    assert rating_reward(1, 5) > rating_reward(1, 4) > rating_reward(1, None)
    assert rating_reward(-1, 1) < rating_reward(-1, 2) < rating_reward(-1, None) == rating_reward(-1, 3)
    for value, stars in ((1, 4), (1, 5), (-1, 1), (-1, 2), (-1, 3)):
        for centre in (-1.0, 0.0, 1.0):
            r = rating_reward(value, stars, centre)
            assert (r > 0) == (value > 0) and abs(r - value) <= STAR_WEIGHT


def test_stars_are_measured_against_what_the_person_usually_gives():
    generous, sparing = star_centre([5] * 10), star_centre([2, 3, 4, 3])
    assert generous > 0.8 and abs(sparing) < 0.1
    assert star_centre([]) == 0.0 and star_centre([5]) == pytest.approx(1 / 3)  # one rating, shrunk toward 3★
    # A 4 from someone who gives 5 to nearly everything says less than a bare 👍; from a sparing rater more.
    assert rating_reward(1, 4, generous) < rating_reward(1, None) < rating_reward(1, 4, sparing)
    assert star_centres({"a": [5, 5], "b": []}) == {"a": pytest.approx(0.5), "b": 0.0}


def test_a_run_reads_each_star_rating_against_its_raters_own_stars(queued_home):
    """Through the worker's own reading of the store (orchestrate.rated_sample with the store's
    stars_given): two people give the same 4 stars; the generous one's counts for less."""
    from rlfleet.shared.config import load_config
    from rlfleet.shared.events import Capture, Message, Rating
    from rlfleet.shared.store import Store
    from rlfleet.worker.orchestrate import rated_sample

    cfg = load_config()
    store = Store(cfg.db_url)
    for i, (who, stars) in enumerate([("gen", 5), ("gen", 5), ("gen", 5), ("gen", 4), ("spa", 2), ("spa", 4)]):
        store.apply_capture(Capture(capture_id=f"c{i}", owner=who, actor=who, prompt=[Message(role="user",
                                    content=f"q{i}")], response=f"a{i}", model=cfg.model))
        store.apply_rating(Rating(actor=who, target=f"c{i}", stars=stars), cfg.model)
    centres = star_centres(store.stars_given(cfg.model))
    rewards = {r.capture_id: rated_sample(r, c, cfg.model, centres).reward for r, c in store.rated_pairs()}
    assert rewards["c3"] < 1.0 < rewards["c5"]  # the same 4 stars
    assert rewards["c4"] < -1.0  # a sparing rater's 2
