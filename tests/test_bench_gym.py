"""bench/gym.py's figures from hand-made episode returns: the learning curve's blocks and intervals, the
held-out difference that decides "learns", the ratios and targets, and a LlamaGym failure reported
beside ours. No model is loaded."""

from __future__ import annotations

import math

import pytest

from bench import gym


def test_a_win_is_a_positive_return_and_draws_are_not_wins():
    assert gym.wins([1.0, 0.0, -1.0, 1.0, 0.5]) == 3


def test_the_curve_cuts_the_episodes_into_blocks_with_a_shorter_last_one():
    returns = [1.0, -1.0, 1.0, 1.0, 0.0, -1.0, -1.0, 1.0, 1.0, 1.0]
    blocks = gym.curve(returns, 4)
    assert [(b["first"], b["last"], b["n"]) for b in blocks] == [(1, 4, 4), (5, 8, 4), (9, 10, 2)]
    assert [b["win_rate"] for b in blocks] == [0.75, 0.25, 1.0]
    assert blocks[0]["mean_return"] == pytest.approx(0.5)
    for b in blocks:
        assert 0.0 <= b["win_lo"] <= b["win_rate"] <= b["win_hi"] <= 1.0
        assert b["return_lo"] <= b["mean_return"] <= b["return_hi"]
    assert blocks[2]["win_hi"] == 1.0 and blocks[2]["win_lo"] < 1.0  # Wilson: no zero width at all-wins


def test_the_mean_interval_is_the_normal_one_and_narrows_with_more_episodes():
    m, lo, hi = gym.mean_ci([1.0, -1.0] * 8)
    assert m == 0.0 and hi == pytest.approx(1.96 * math.sqrt(16 / 15) / 4)
    assert lo == -hi
    assert gym.mean_ci([1.0, -1.0] * 32)[2] < hi
    assert gym.mean_ci([0.5]) == (0.5, 0.5, 0.5)
    assert all(math.isnan(v) for v in gym.mean_ci([]))


def test_the_held_out_difference_is_paired_seed_by_seed():
    # The same 100 hands: the served version wins 10 more and agrees on the rest. Two independent rates
    # would put 0.05 inside ±0.14; paired, only the 10 hands that parted add to the spread.
    base = [1.0] * 40 + [-1.0] * 60
    served = [1.0] * 50 + [-1.0] * 50
    won = [[1.0 if r > 0 else 0.0 for r in rets] for rets in (served, base)]
    d, lo, hi = gym.paired_diff_ci(*won)
    assert d == pytest.approx(0.1) and lo == pytest.approx(0.1 - 1.96 * math.sqrt(9 / 99) / 10) and lo > 0
    assert gym.paired_diff_ci(served, base)[0] == pytest.approx(0.2)  # returns: a loss turned win is +2
    # the same rates on hands that part both ways: no learning read
    mixed = [-1.0] * 20 + [1.0] * 30 + [-1.0] * 50
    d, lo, hi = gym.paired_diff_ci([1.0 if r > 0 else 0.0 for r in mixed], [1.0 if r > 0 else 0.0 for r in base])
    assert d == pytest.approx(-0.1) and lo < 0 < hi
    assert gym.paired_diff_ci([1.0, 0.0], [0.0, 1.0])[0] == 0.0
    with pytest.raises(ValueError, match="paired"):
        gym.paired_diff_ci([1.0], [1.0, 0.0])
    assert all(math.isnan(v) for v in gym.paired_diff_ci([], []))


def raw(side: str, returns: list[float], loop_s: float, peak: int, **extra) -> dict:
    return {"side": side, "episodes": len(returns), "returns": returns, "turns": [1] * len(returns),
            "load_s": 10.0, "loop_s": loop_s, "act_s": 1.0, "close_s": 1.0,
            "hits": 0, "actions": len(returns), "peak_rss_bytes": peak, **extra}


def test_ratios_targets_and_a_report_with_both_sides():
    served = [1.0] * 60 + [-1.0] * 40
    base = [1.0] * 30 + [-1.0] * 70
    ours = gym.summarise(raw("ours", [1.0, -1.0] * 8, 8.0, 1 << 30, runs=[{"version": "v0001", "promoted": True}],
                             heldout={"episodes": 100, "version": "v0001", "served": served, "base": base,
                                      "served_hits": 7, "served_turns": 120, "base_hits": 0, "base_turns": 100,
                                      "served_hits_by_sum": {"≤11": [5, 20], "12–16": [2, 50], "≥17": [0, 50]},
                                      "base_hits_by_sum": {"≤11": [0, 20], "12–16": [0, 40], "≥17": [0, 0]}}), 8)
    ours["heldout"]["reference"] = {"always stay": 0.377, "basic strategy": 0.429}
    theirs = gym.summarise(raw("llamagym", [-1.0, 0.0] * 8, 64.0, 4 << 30, batches=[{"after_episode": 8}]), 8)
    assert ours["episodes_per_s"] == 2.0 and theirs["episodes_per_s"] == 0.25
    assert ours["episodes_per_s_with_load"] == pytest.approx(16 / 18)
    assert ours["heldout"]["learns"] and "served" not in ours["heldout"]
    assert ours["heldout"]["served_win_rate"] == 0.6 and ours["heldout"]["base_win_rate"] == 0.3
    assert gym.targets(ours, theirs) == {"learns": True, "speed_3x": True, "half_memory": True}
    fig = {"ours": ours, "llamagym": theirs, "speed_ratio": 8.0, "memory_ratio": 0.25,
           "targets": gym.targets(ours, theirs)}
    text = gym.report(fig)
    assert "8.00× the episodes/s, 0.25× the peak memory" in text
    assert "Hits: served 7 of 120 turns, base 0 of 100." in text
    assert "Fixed policies on the same deals: always stay 0.377, basic strategy 0.429." in text
    assert ("Hit rate by the player's sum: ≤11 served 0.25 (5/20), base 0.00 (0/20); 12–16 served 0.04 (2/50), "
            "base 0.00 (0/40); ≥17 served 0.00 (0/50), base –.") in text
    assert [gym.sum_bucket(s) for s in (4, 11, 12, 16, 17, 21)] == ["≤11", "≤11", "12–16", "12–16", "≥17", "≥17"]
    assert "difference +0.300" in text and "learns (held-out difference above 0) met" in text
    assert "| 1–8 |" in text and "| 9–16 |" in text


def test_a_llamagym_failure_is_said_and_ours_still_reported():
    ours = gym.summarise(raw("ours", [1.0, -1.0, 0.0], 3.0, 1 << 30), 2)
    fig = {"ours": ours, "llamagym_error": "exit 1:\nImportError: cannot import name 'top_k_top_p_filtering'",
           "targets": gym.targets(ours, None)}
    text = gym.report(fig)
    assert "LlamaGym could not run: exit 1:\nImportError: cannot import name 'top_k_top_p_filtering'" in text
    assert "ours (rlfleet.gym)" in text and "LlamaGym 0.1.1" not in text.split("\n\n")[0]
    assert fig["targets"] == {"learns": None, "speed_3x": None, "half_memory": None}
    assert "≥ 3× LlamaGym's episodes/s not measured" in text


def test_llamagym_played_in_parts_says_how_far_it_got_and_its_timings_add_up():
    theirs = gym.summarise(raw("llamagym", [-1.0, 1.0] * 8, 64.0, 4 << 30, finished=False, planned=1000, parts=2,
                               resume_load_s=9.0), 8)
    text = gym.report({"llamagym": theirs, "targets": gym.targets(None, theirs)})
    assert theirs["episodes_per_s"] == 0.25
    assert ("LlamaGym played in 2 part(s) from a saved state (9 s of loads after the first, not in its figures): "
            "16 of 1000 episodes so far; the same command goes on.") in text
    done = gym.summarise(raw("llamagym", [1.0] * 4, 8.0, 1 << 30, finished=True, planned=4, parts=3,
                             resume_load_s=20.0), 2)
    assert "played in 3 part(s) from a saved state (20 s of loads after the first, not in its figures)." in (
        gym.report({"llamagym": done, "targets": gym.targets(None, done)}))
    one_go = gym.summarise(raw("llamagym", [1.0] * 4, 8.0, 1 << 30), 2)
    assert "part(s)" not in gym.report({"llamagym": one_go, "targets": gym.targets(None, one_go)})


def test_llamagym_parts_need_a_state_folder_and_a_state_resumes_only_its_own_settings(tmp_path, capsys):
    import argparse

    import torch

    from bench.gym_llamagym import STATE_FILE, load_state, settings_of

    with pytest.raises(SystemExit):
        gym.parse(["--only", "llamagym", "--llamagym-until", "60"])
    assert "--llamagym-until needs --llamagym-state" in capsys.readouterr().err
    args = argparse.Namespace(model_dir="/somewhere/smollm2-135m-instruct-hf", episodes=1000, seed=0,
                              max_new_tokens=32, verbatim=False)
    mine = settings_of(args)
    assert mine["model_dir"] == "smollm2-135m-instruct-hf"  # the same weights copied elsewhere resume
    assert load_state(tmp_path, None, mine) is None  # nothing saved yet: a fresh start
    torch.save({"progress": {"settings": {**mine, "seed": 5000}}}, tmp_path / STATE_FILE)
    with pytest.raises(SystemExit, match="saved by a run with .*'seed': 5000"):
        load_state(tmp_path, None, mine)


def test_the_example_agent_reads_only_blackjack_s_two_actions():
    """LlamaGym's parser returns any digit after "Action: "; Blackjack-v1 asserts on one it lacks."""
    from bench.gym_llamagym import BlackjackPrompts

    read = BlackjackPrompts().extract_action
    assert [read("Action: 1"), read("Action: 0"), read("I hit. Action: 2"), read("hit me"), read("no idea")] == [
        1, 0, 0, 1, 0]


def test_the_reference_policies_play_the_held_out_deals_and_basic_strategy_beats_staying():
    assert [gym.basic_strategy(o) for o in ((11, 10, 0), (12, 4, 0), (12, 2, 0), (16, 7, 0), (16, 6, 0),
                                             (17, 1, 0), (18, 10, 1), (18, 5, 1), (19, 9, 1))] == [
        1, 0, 1, 1, 0, 0, 1, 0, 0]
    rates = gym.reference_win_rates([gym.HELDOUT_SEED + i for i in range(1000)])
    assert set(rates) == {"always stay", "hit below 17", "basic strategy"}
    # basic strategy wins about 43 % of hands and staying on every one about 38 %: 1,000 deals tell them apart
    assert rates["basic strategy"] > rates["always stay"] + 0.02
    assert all(0.3 < r < 0.5 for r in rates.values())
