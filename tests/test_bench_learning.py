"""The learning benchmark: its raters and metrics by hand, and a small run on the tiny model that
must show the simulated user's preference taking hold through the real pipeline."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinymodel import one_torch_thread

from bench.learning.__main__ import main
from bench.learning.metrics import collapse_signals, margin, preferred_rate, repeat_share, wilson
from bench.learning.raters import CONTROLS, Judgement, load_rater, preference
from bench.learning.simulate import heldout_prompts, rating_event, typed
from rlfleet.shared.config import TrainSettings


@pytest.mark.parametrize(
    "spec, answer, expected",
    [
        ("short", "one two three", 1),
        ("short:3", "one two three", -1),
        ("short:4", "one, two... three!", 1),
        ("question", "Shall we go?  ", 1),
        ("question", "We shall go.", -1),
        ("topic:ocean", "The Ocean is wide.", 1),
        ("topic:ocean", "Oceanic trenches.", -1),  # a word, not a substring
        ("avoid:however", "However, no.", -1),
        ("avoid:however", "Yes.", 1),
        ("polite", "Glad to help! Here it is.", 1),
        ("polite", "Here it is.", -1),
        ("example", "Bees dance, for example.", 1),
        ("example", "E.g. honey.", 1),
        ("example", "For instance: wax.", 1),
        ("example", "A bee is an example of an insect.", -1),  # a definition, not an example given
        ("example", "Examples abound.", -1),
        ("direct", "You light it.", 1),
        ("direct", "It is yours, you'll see.", 1),
        ("direct", "Young bees light it.", -1),  # a word that starts with "you" is not "you"
    ],
)
def test_named_raters(spec, answer, expected):
    assert preference(spec).rate("a prompt", answer) == expected


@pytest.mark.parametrize(
    "spec, disliked, comment",
    [
        ("short:3", "one two three", "too long, keep it under 3 words"),
        ("question", "We shall go.", "end with a question"),
        ("topic:ocean", "The sky.", "mention ocean"),
        ("avoid:however", "However, no.", "don't say however"),
        ("polite", "Here it is.", "be more polite"),
        ("example", "Bees dance.", "give an example"),
        ("direct", "Bees dance.", "talk to me directly, say you"),
    ],
)
def test_named_raters_say_what_they_want_on_a_thumbs_down(spec, disliked, comment):
    pref = preference(spec)
    assert pref.judge("a prompt", disliked) == Judgement(-1, comment)
    assert pref.rate("a prompt", disliked) == -1
    assert preference("short:3").judge("a prompt", "one two") == Judgement(1, None)  # a 👍 says nothing


def test_rater_specs_are_checked():
    with pytest.raises(ValueError, match="unknown preference 'tall'"):
        preference("tall")
    with pytest.raises(ValueError, match="bad argument"):
        preference("short:many")
    with pytest.raises(ValueError, match="takes no argument"):
        preference("question:x")


def test_external_rater(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text('def likes_yes(prompt, answer):\n    """yes-sayer"""\n    return 1 if "yes" in answer else None\n'
                 "def broken(prompt, answer):\n    return 5\n")
    pref = load_rater(f"{f}:likes_yes")
    assert pref.rate("p", "yes!") == 1 and pref.rate("p", "no") is None
    assert pref.description == "yes-sayer"
    with pytest.raises(ValueError, match="returned 5"):
        load_rater(f"{f}:broken").rate("p", "a")
    with pytest.raises(ValueError, match="no function"):
        load_rater(f"{f}:absent")
    with pytest.raises(ValueError, match="FILE.py:FUNC"):
        load_rater("mine")


def test_external_rater_with_comments(tmp_path):
    f = tmp_path / "worded.py"
    f.write_text(
        "def vague(prompt, answer):\n    return (-1, '  too vague ') if 'maybe' in answer else (1, None)\n"
        "def not_a_str(prompt, answer):\n    return (-1, 5)\n"
        "def triple(prompt, answer):\n    return (1, 'a', 'b')\n"
        "def orphan(prompt, answer):\n    return (None, 'why')\n"
        "def yes(prompt, answer):\n    return True\n"
        "def rambling(prompt, answer):\n    return (-1, 'x' * 2001)\n"
    )  # fmt: skip
    pref = load_rater(f"{f}:vague")
    assert pref.judge("p", "maybe so") == Judgement(-1, "too vague") and pref.rate("p", "maybe so") == -1
    assert pref.judge("p", "so") == Judgement(1, None)
    shape = r"returned .*; a rater returns 1, -1 or None, or a pair \(value, comment\)"
    for func in ("not_a_str", "yes"):
        with pytest.raises(ValueError, match=shape):
            load_rater(f"{f}:{func}").judge("p", "a")
    with pytest.raises(ValueError, match="stars are 1 to 5"):  # a triple's third is its stars
        load_rater(f"{f}:triple").judge("p", "a")
    with pytest.raises(ValueError, match="a comment without a rating"):
        load_rater(f"{f}:orphan").judge("p", "a")
    with pytest.raises(ValueError, match="over 2000 characters"):
        load_rater(f"{f}:rambling").judge("p", "a")


def test_short_grades_in_stars_that_agree_with_its_thumb_and_external_raters_may_too(tmp_path):
    pref = preference("short:10")
    graded = [pref.graded("p", " ".join(["w"] * n)) for n in (3, 7, 12, 17, 25)]
    assert [(j.value, j.stars) for j in graded] == [(1, 5), (1, 4), (-1, 3), (-1, 2), (-1, 1)]
    assert graded[2].comment == "too long, keep it under 10 words"
    assert pref.judge("p", "w w w") == Judgement(1, None)  # without --stars: the thumb alone
    assert preference("question").graded("p", "Why?") == Judgement(1, None)  # a preference that does not grade
    f = tmp_path / "starry.py"
    f.write_text("def fine(prompt, answer):\n    return (1, 'nice', 5)\n"
                 "def wrong(prompt, answer):\n    return (1, None, 2)\n"
                 "def many(prompt, answer):\n    return (-1, None, 9)\n")
    assert load_rater(f"{f}:fine").judge("p", "a") == Judgement(1, "nice", 5)
    with pytest.raises(ValueError, match="2 stars are a thumbs-down"):
        load_rater(f"{f}:wrong").judge("p", "a")
    with pytest.raises(ValueError, match="stars are 1 to 5"):
        load_rater(f"{f}:many").judge("p", "a")


def test_the_simulated_user_rates_as_a_person_types_it():
    from rlfleet.shared.ingress.usecases import UseCases
    from rlfleet.shared.permissions import Grants, PermissionTable

    assert typed(-1, "too long, keep it under 25 words") == "/rl bad too long, keep it under 25 words"
    assert typed(1, None) == "/rl good"
    cases = UseCases(PermissionTable({"cli": Grants(admins=frozenset({"local"}))}), "m")
    ev = rating_event(cases, "cap-1", -1, "mention ocean")
    assert (ev.value, ev.comment, ev.target, ev.source, ev.actor) == (-1, "mention ocean", "cap-1", "cli", "local")
    assert rating_event(cases, "cap-1", 1, None).comment is None
    assert typed(-1, "too long", 2) == "/rl 2 too long"
    starred = rating_event(cases, "cap-1", -1, "too long", 2)
    assert (starred.value, starred.stars, starred.comment) == (-1, 2, "too long")
    with pytest.raises(ValueError, match=r"not a /rl good\|bad command"):  # past the command's length limit
        rating_event(cases, "cap-1", -1, "x" * 2000)


def test_then_switches_the_simulated_users_preference():
    from bench.learning.metrics import Checkpoint
    from bench.learning.simulate import BenchConfig, BenchResult

    first, second = preference("short:3"), preference("question")
    bc = BenchConfig(preference=first, ratings=8, then=second)
    assert bc.switch == 4 and [bc.rater_at(g).name for g in range(8)] == ["short:3"] * 4 + ["question"] * 4
    assert bc.rater_at(4).judge("p", "Is it long enough?") == Judgement(1, None)  # the new taste rates now
    assert bc.rater_at(3).rate("p", "Is it long enough?") == -1
    assert bc.measured is second  # the rate is of the preference the user ends with
    early = BenchConfig(preference=first, ratings=8, then=second, switch_at=2)
    assert [early.rater_at(g).name for g in (1, 2)] == ["short:3", "question"]
    alone = BenchConfig(preference=first, ratings=8)
    assert alone.switch is None and alone.rater_at(7) is first and alone.measured is first

    # The first preference's rate at every checkpoint: before, at the switch, after; how much was kept.
    def cp(ratings, rate, first_rate, replayed):
        return Checkpoint(ratings=ratings, version=None, rate=rate, ci95=(0.0, 1.0), judged=16, margin=0.0,
                          answer_words=5.0, distinct2=0.5, repeat=0.0, entropy_ratio=1.0, seconds=1.0,
                          first_rate=first_rate, first_ci95=(0.1, 0.9), replayed=replayed)  # fmt: skip

    out = BenchResult(bc, [cp(0, 0.1, 0.2, 0), cp(4, 0.1, 0.7, 0), cp(8, 0.6, 0.65, 2)], [], 1.0).summary()
    assert (out["then"], out["switch_at"], out["replayed"]) == ("question", 4, 2)
    assert (out["first_base_rate"], out["first_switch_rate"], out["first_final_rate"]) == (0.2, 0.7, 0.65)
    assert out["first_kept"] == pytest.approx(-0.05) and out["first_final_ci95"] == [0.1, 0.9]
    assert out["delta"] == pytest.approx(0.5) and out["checkpoints"][2]["first_ci95"] == [0.1, 0.9]
    plain = BenchResult(alone, [cp(0, 0.1, None, 0), cp(8, 0.2, None, 0)], [], 1.0).summary()
    assert plain["then"] is None and "first_kept" not in plain


def test_then_switch_at_and_replay_options():
    from bench.learning.__main__ import parse

    args = parse(["--preference", "short:3", "--then", "question", "--switch-at", "8", "--replay", "0"])
    assert (args.then, args.switch_at, args.replay) == ("question", 8, 0.0)
    assert parse(["--preference", "short:3", "--explore", "4"]).explore == 4
    assert parse(["--preference", "short:3"]).explore is None  # the config's train.explore
    assert [parse(["--preference", "short:3", *a]).rewrite for a in ([], ["--rewrite"], ["--no-rewrite"])] == \
        [None, True, False]  # None: the config's train.rewrite
    assert parse(["--preference", "short:3", "--beta", "0.1"]).beta == 0.1
    assert parse(["--preference", "short:3"]).beta is None  # the preset's KL weight
    args = parse(["--preference", "short:3", "--kl-top-k", "32", "--unlikelihood", "1.5"])
    assert (args.kl_top_k, args.unlikelihood) == (32, 1.5)
    assert parse(["--preference", "short:3"]).kl_top_k is None
    args = parse(["--preference", "short:3", "--entropy-hinge", "2", "--no-fallback"])
    assert (args.entropy_hinge, args.no_fallback) == (2.0, True)
    assert parse(["--preference", "short:3"]).no_fallback is False  # the config's train.fallback
    for bad in (["--switch-at", "8"], ["--then", "question", "--switch-at", "64"], ["--replay", "-1"],
                ["--explore", "-1"], ["--beta", "-0.1"], ["--kl-top-k", "-1"], ["--unlikelihood", "-2"],
                ["--entropy-hinge", "-1"]):
        with pytest.raises(SystemExit):
            parse(["--preference", "short:3", *bad])


def test_metrics_by_hand():
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)  # the textbook value
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    rate, ci, n = preferred_rate([1, -1, None, 1])
    assert rate == pytest.approx(2 / 3) and n == 3 and ci[0] < rate < ci[1]
    assert math.isnan(preferred_rate([None])[0])
    assert margin([-1.0, -2.0], [-3.0]) == pytest.approx(1.5) and math.isnan(margin([], [-1.0]))
    words, distinct = collapse_signals([[1, 2, 1, 2, 1]], ["a b", "c d e f"])
    assert words == 3.0 and distinct == pytest.approx(2 / 4)
    # Repeated trigrams as the gate counts them, on answers cut before the end token (9) like the gate's:
    # 123 231 312 [123] -> 1/4 repeated; an answer with no trigram repeats none.
    assert repeat_share([[1, 2, 3, 1, 2, 3, 9], [4, 5, 9]], end_id=9) == pytest.approx((0.25 + 0.0) / 2)
    assert repeat_share([[1, 2, 3, 1, 2, 3, 9]], end_id=None) == pytest.approx(1 / 5)


def test_a_small_benchmark_run_shows_the_preference_taking_hold(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # Through the real pipeline (queue, store, trigger, worker, gate, registry, responder) on the
    # tiny model: a user who likes short answers. The tiny model needs a big step (see test_trainer).
    monkeypatch.delenv("RLFLEET_HOME", raising=False)
    rater = tmp_path / "rater.py"
    rater.write_text("def short(prompt, answer):\n    return 1 if len(answer) < 30 else (-1, 'too long')\n")
    # --batch 1: every held-out answer sampled alone under its own seed. The margins asserted below were
    # measured on those answers; a batch samples others from the same distribution.
    with one_torch_thread():
        code = main([
            "--model", str(tiny_model_dir), "--rater", f"{rater}:short", "--ratings", "16", "--threshold", "8",
            "--lr", "3e-3", "--steps", "8", "--preset", "aggressive", "--heldout", "4", "--samples", "4",
            "--batch", "1", "--device", "cpu", "--home", str(tmp_path / "bench"), "--json",
        ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("preference", "ratings", "objective", "base_rate", "final_rate", "delta", "ci95",
                "margin_before", "margin_after", "seconds"):
        assert key in out, key
    assert out["ratings"] == 16 and out["objective"] == "mispo"
    assert [c["ratings"] for c in out["checkpoints"]] == [0, 8, 16]
    assert any(r["state"] == "succeeded" for r in out["runs"])
    # The held-out margin is the sensitive measure here: on the tiny model, sampled answers at a ~6 %
    # base rate over 16 samples move the rate in steps of 0.06, within noise of a few runs.
    margins = [c["margin"] for c in out["checkpoints"]]
    assert margins == sorted(margins) and out["margin_after"] > out["margin_before"] + 0.05, out
    assert out["delta"] == pytest.approx(out["final_rate"] - out["base_rate"])
    assert out["entropy_ratio"] > 0.8  # learned, not collapsed
    assert (tmp_path / "bench" / "mispo" / "rlfleet.db").is_file()  # --home keeps the run's data
    # Every checkpoint is also scored by the other named preferences (the control), on the same answers.
    assert all(set(c["controls"]) == set(CONTROLS) for c in out["checkpoints"])
    # ... and keeps a few of them as text: the first sample of the first three held-out prompts.
    shown = [[e["prompt"] for e in c["examples"]] for c in out["checkpoints"]]
    assert shown[0] == heldout_prompts(3) and all(s == shown[0] for s in shown)
    assert all(isinstance(e["answer"], str) for c in out["checkpoints"] for e in c["examples"])
    assert out["controls_delta"]["short:30"] == pytest.approx(
        out["checkpoints"][-1]["controls"]["short:30"] - out["checkpoints"][0]["controls"]["short:30"])
    # The comment went in as `/rl bad too long` does: stored with its rating, a 👍 without one.
    with sqlite3.connect(tmp_path / "bench" / "mispo" / "rlfleet.db") as db:
        stored = db.execute("SELECT value, comment FROM ratings").fetchall()
    assert len(stored) == 16 and {(-1, "too long"), (1, None)} >= set(stored) and (-1, "too long") in stored
    # The fluency figures beside the rate, and what the gate did.
    first, last = out["checkpoints"][0], out["checkpoints"][-1]
    assert (out["base_distinct2"], out["final_distinct2"]) == (first["distinct2"], last["distinct2"])
    assert (out["base_repeat"], out["final_repeat"]) == (first["repeat"], last["repeat"])
    assert all(0 < c["distinct2"] <= 1 and 0 <= c["repeat"] < 1 for c in out["checkpoints"])
    promoted = [r for r in out["runs"] if r["state"] == "succeeded" and r["verdict"] == "promoted"]
    assert out["promoted"] == len(promoted) >= 1
    # ... with the gate's own figures for each run it judged: why it promoted or refused.
    for r in promoted:
        assert r["heldout_kl"] >= 0 and r["entropy_ratio"] > 0 and r["distinct2_ratio"] > 0, r
        assert 0 <= r["repetition"] <= 1 and 0 <= r["repetition_base"] <= 1, r
    # The last run's reward model (None only where it had under two answers of a class, and then says so).
    last_run = out["runs"][-1]
    # The hindsight teacher read the comments: the last run's gap, and how many of them it taught from.
    assert out["comments"] is True and isinstance(out["teacher_gap"], float)
    assert out["teacher_gap"] == last_run["teacher_gap"]
    # ... and what the hint can teach at most: the base's rate with the hint in the held-out prompts.
    assert out["teacher_hint"] == "too long" and 0 <= out["teacher_rate"] <= 1
    lo, hi = out["teacher_ci95"]
    assert lo <= out["teacher_rate"] <= hi
    assert last_run["hinted"] >= 1 and 0 <= last_run["hint_taught"] <= last_run["hinted"]
    assert out["reward_model_auc"] == last_run["reward_model_auc"] and last_run["reward_model_reason"]
    assert all(r["reward_model_auc"] is None or 0 <= r["reward_model_auc"] <= 1 for r in out["runs"])
    # Exploration is on by default: each run says whether it sampled answers and why.
    k = TrainSettings().explore
    assert all(bool(r["explored"]) == r["explore_reason"].startswith(f"{k} answers to each") for r in out["runs"])
    assert all(r["explore_reason"] != "off (train.explore = 0)" for r in out["runs"])
    # How many earlier ratings each checkpoint's runs replayed (train.replay's default: half a run's own).
    replayed = [c["replayed"] for c in out["checkpoints"]]
    assert replayed[0] == 0 and sum(replayed) == out["replayed"] == sum(r["replayed"] or 0 for r in out["runs"])
    assert out["then"] is None and "first_kept" not in out
    # What each run trained with, as it ran: the command line's overrides over the preset's values.
    for r in out["runs"]:
        if r["state"] == "succeeded":
            assert r["train"]["lr"] == pytest.approx(3e-3) and r["train"]["steps"] == 8, r["train"]
            assert r["train"]["beta"] == 0.02 and r["train"]["advantage"] == "ema", r["train"]  # aggressive's


def test_held_out_answers_in_batches_and_ratings_without_words(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # The default held-out set (16 prompts x 4 answers) in batches of 5 (a short last one): every answer
    # is there at every checkpoint. --no-comments: the thumbs alone.
    monkeypatch.delenv("RLFLEET_HOME", raising=False)
    with one_torch_thread():
        code = main([
            "--model", str(tiny_model_dir), "--preference", "short:3", "--ratings", "2", "--threshold", "8",
            "--batch", "5", "--max-new-tokens", "8", "--no-comments", "--device", "cpu",
            "--home", str(tmp_path / "bench"), "--json",
        ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["judged"] for c in out["checkpoints"]] == [64, 64] and out["runs"] == [] and out["promoted"] == 0
    assert out["comments"] is False and 0 <= out["base_repeat"] < 1
    with sqlite3.connect(tmp_path / "bench" / "mispo" / "rlfleet.db") as db:
        assert db.execute("SELECT count(*), count(comment) FROM ratings").fetchone() == (2, 0)


def _summary(objective, seed, rates, judged=16, preset="balanced"):
    cps = [{"ratings": 32 * i, "rate": r, "judged": judged, "ci95": list(wilson(round(r * judged), judged)),
            "margin": 0.1 * i, "answer_words": 30.0 - i, "distinct2": 0.8, "repeat": 0.02 + 0.01 * i + 0.01 * seed,
            "entropy_ratio": 1.0}
           for i, r in enumerate(rates)]  # fmt: skip
    return {"preference": "short:30", "objective": objective, "model": "m", "preset": preset, "threshold": 32,
            "seed": seed, "ratings": cps[-1]["ratings"], "base_rate": rates[0], "final_rate": rates[-1],
            "delta": rates[-1] - rates[0], "ci95": cps[-1]["ci95"], "margin_before": 0.0,
            "margin_after": cps[-1]["margin"], "answer_words_before": 30.0, "answer_words_after": 28.0,
            "distinct2_before": 0.8, "distinct2_after": 0.8, "base_repeat": cps[0]["repeat"],
            "final_repeat": cps[-1]["repeat"], "entropy_ratio": 1.0, "checkpoints": cps,
            "runs": [{"state": "succeeded"}], "seconds": 10.0 + seed}  # fmt: skip


def test_seeds_of_one_variant_pool_into_one_row_with_a_narrower_interval():
    from bench.learning.grid import _labelled
    from bench.learning.report import markdown_table, pool

    runs = _labelled([_summary("mispo", 0, [0.25, 0.5]), _summary("mispo", 1, [0.125, 0.75]),
                      _summary("soft", 0, [0.25, 0.25])])  # fmt: skip
    rows = pool(runs)
    assert [r["label"] for r in rows] == ["mispo", "soft"]
    mispo = rows[0]
    assert mispo["seeds"] == 2 and mispo["checkpoints"][-1]["judged"] == 32
    assert mispo["base_rate"] == pytest.approx(6 / 32) and mispo["final_rate"] == pytest.approx(20 / 32)
    assert mispo["delta"] == pytest.approx(14 / 32) and mispo["seconds"] == pytest.approx(10.5)
    single = wilson(12, 16)
    assert mispo["ci95"][1] - mispo["ci95"][0] < single[1] - single[0]
    assert len(mispo["runs"]) == 2 and rows[1] is runs[2]  # one seed: the run itself
    table = markdown_table(rows).splitlines()
    assert table[2].startswith("| mispo | 32 | 2 | 0.19 | 0.62 | +0.44 |") and len(table) == 4
    # Repeated trigrams, the fluency a gain must keep: averaged over the seeds (2.0 and 3.0 % before).
    assert mispo["base_repeat"] == pytest.approx(0.025) and "| 2.5 % → 3.5 % |" in table[2]
    # A version served from halfway through its run is counted as promoted, and said.
    runs[0]["runs"] = [{"state": "succeeded", "fallback": "halfway"}]
    assert "| 2/2 (1 halfway) | n/a · n/a |" in markdown_table(pool(runs)).splitlines()[2]
    # The hindsight teacher's own rate and gap, averaged over the seeds that measured them.
    runs[0].update(teacher_rate=0.25, teacher_gap=0.02)
    runs[1].update(teacher_rate=0.5, teacher_gap=0.04)
    assert "| 0.38 · +0.030 |" in markdown_table(pool(runs)).splitlines()[2]


def test_labels_name_only_what_varies_within_a_preference():
    from bench.learning.grid import _labelled, points

    grid = points(["short:30"], ["mispo", "soft"], ["balanced", "careful"], [32], [0, 1])
    assert len(grid) == 8 and grid[0].name() == "short-30__mispo__balanced__t32__s0"
    assert grid[0].name(["--lr", "1e-4"]) != grid[0].name(["--lr", "2e-4"])  # other options: another run
    labels = {s["label"] for s in _labelled([_summary("mispo", 0, [0, 0], preset=p) for p in ("balanced", "careful")]
                                            + [_summary("soft", 0, [0, 0])])}  # fmt: skip
    assert labels == {"mispo · balanced", "mispo · careful", "soft · balanced"}
    tuned = {**_summary("mispo", 0, [0, 0]), "overrides": {"lr": 5e-5}}
    assert {s["label"] for s in _labelled([_summary("mispo", 0, [0, 0]), tuned])} == {"mispo · lr=preset",
                                                                                     "mispo · lr=5e-05"}
    rules = [{**_summary("mispo", 0, [0, 0]), "overrides": {"advantage": a}} for a in ("ema", "asymmetric")]
    assert {s["label"] for s in _labelled(rules)} == {"mispo · advantage=ema", "mispo · advantage=asymmetric"}
    # A run that recorded what it trained with is labelled by that, not by "preset": the preset's
    # default moved between these two (unlikelihood 0, then 1), and only one of them said so.
    ran = [{**_summary("mispo", 0, [0, 0]), "overrides": {"unlikelihood": 1.0} if u else {},
            "runs": [{"state": "succeeded", "train": {"beta": 0.04, "unlikelihood": u}}]} for u in (0.0, 1.0)]
    assert {s["label"] for s in _labelled(ran)} == {"mispo · unlikelihood=0", "mispo · unlikelihood=1"}
    # A setting only newer runs record, at one value, is not a difference; an older run's missing
    # value of a setting that does differ reads "preset". Switches read on/off.
    old = {**_summary("mispo", 0, [0, 0]), "overrides": {"replay": 0.5}}
    new = [{**_summary("mispo", 0, [0, 0]), "runs": [{"state": "succeeded", "train": {"lr": 2e-4, "replay": 0.0,
                                                                                     "fallback": f}}]}
           for f in (True, False)]
    assert {s["label"] for s in _labelled([old, *new])} == {
        "mispo · fallback=preset · replay=0.5", "mispo · fallback=on · replay=0", "mispo · fallback=off · replay=0"}
    # A run that records its settings but not one newer code added ran before it existed: that differs.
    before = {**_summary("mispo", 0, [0, 0]), "runs": [{"state": "succeeded", "train": {"lr": 2e-4}}]}
    after = {**_summary("mispo", 0, [0, 0]), "runs": [{"state": "succeeded", "train": {"lr": 2e-4, "balance": 16.0}}]}
    assert {s["label"] for s in _labelled([before, after])} == {"mispo · balance=preset", "mispo · balance=16"}


def test_grid_runs_every_point_resumes_and_reports(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from bench.learning.grid import main as grid

    monkeypatch.delenv("RLFLEET_HOME", raising=False)
    out = tmp_path / "runs"
    extra = ["--", "--model", str(tiny_model_dir), "--heldout", "2", "--samples", "1", "--max-new-tokens", "8",
             "--device", "cpu", "--lr", "3e-3", "--steps", "2"]  # fmt: skip
    argv = ["run", "--preference", "short:5", "--objective", "mispo,reinforce", "--threshold", "4", "--ratings", "4",
            "--jobs", "2", "--threads", "1", "--out", str(out), *extra]  # fmt: skip
    assert grid(argv) == 0
    done = sorted(p.name for p in out.glob("*.json"))
    stems = [d.rsplit("__x", 1)[0] for d in done]
    assert stems == ["short-5__mispo__balanced__t4__s0", "short-5__reinforce__balanced__t4__s0"]
    assert len({d.rsplit("__x", 1)[1] for d in done}) == 1  # the pass-through options, hashed into the name
    assert not list(out.glob("*.part"))
    stamp = {p: p.stat().st_mtime_ns for p in out.glob("*.json")}
    assert grid(argv) == 0  # everything is there: nothing reruns
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.json")} == stamp
    capsys.readouterr()
    assert grid(["report", str(out), "--plots", str(tmp_path / "plots")]) == 0
    text = capsys.readouterr().out
    assert "### short:5 · 4 ratings" in text and "| mispo | 4 | 1 |" in text and "| reinforce | 4 | 1 |" in text
    assert (tmp_path / "plots" / "short-5.png").stat().st_size > 1000
    assert grid(["run", "--preference", "short", "--objective", "dpo", "--out", str(out)]) == 2


def test_a_grid_stopped_by_a_signal_interrupts_its_runs_so_they_can_shut_down(tmp_path):
    """A stand-in run that records the interrupt it gets (a benchmark run shuts its embedded Redis server
    down on one) and would otherwise sleep for minutes; the grid is terminated while it runs."""
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    child = (f"import signal, sys, time, pathlib; pathlib.Path({str(started)!r}).touch()\n"
             f"def bye(*_): pathlib.Path({str(stopped)!r}).touch(); sys.exit(1)\n"
             "signal.signal(signal.SIGINT, bye); time.sleep(600)")
    script = tmp_path / "grid_run.py"
    script.write_text(
        "import sys\n"
        "from bench.learning import grid\n"
        f"grid.Point.argv = lambda self, ratings, extra: [sys.executable, '-c', {child!r}]\n"
        f"sys.exit(grid.main(['run', '--preference', 'short', '--out', {str(tmp_path / 'runs')!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), "the stand-in run never started"
    proc.terminate()
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert stopped.exists()  # the run got its interrupt before the grid went
    assert not list((tmp_path / "runs").glob("*.json"))


def test_grid_report_pools_seeds_or_shows_each(tmp_path, capsys):
    from bench.learning.grid import main as grid

    for seed, rates in ((0, [0.25, 0.5]), (1, [0.125, 0.75])):
        (tmp_path / f"s{seed}.json").write_text(json.dumps(_summary("mispo", seed, rates)))
    assert grid(["report", str(tmp_path)]) == 0
    pooled = [row for row in capsys.readouterr().out.splitlines() if row.startswith("| mispo")]
    assert len(pooled) == 1 and pooled[0].startswith("| mispo | 32 | 2 | 0.19 | 0.62 |")
    assert grid(["report", str(tmp_path), "--per-seed"]) == 0
    rows = [row for row in capsys.readouterr().out.splitlines() if row.startswith("| mispo")]
    assert [r.split(" | ")[0] for r in rows] == ["| mispo · seed 0", "| mispo · seed 1"]
    assert rows[0].startswith("| mispo · seed 0 | 32 | 1 | 0.25 | 0.50 |") and "| 2.0 % → 3.0 % |" in rows[0]


def test_grid_report_of_an_empty_folder_is_a_clear_error(tmp_path, capsys):
    from bench.learning.grid import main as grid

    assert grid(["report", str(tmp_path)]) == 2
    assert "no benchmark JSON" in capsys.readouterr().err
