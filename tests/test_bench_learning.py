"""The learning benchmark: its raters and metrics by hand, and a small run on the tiny model that
must show the simulated user's preference taking hold through the real pipeline."""

from __future__ import annotations

import json
import math

import pytest
from conftest import one_torch_thread

from bench.learning.__main__ import main
from bench.learning.metrics import collapse_signals, margin, preferred_rate, wilson
from bench.learning.raters import load_rater, preference


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
    ],
)
def test_named_raters(spec, answer, expected):
    assert preference(spec).rate("a prompt", answer) == expected


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


def test_a_small_benchmark_run_shows_the_preference_taking_hold(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # Through the real pipeline (queue, store, trigger, worker, gate, registry, responder) on the
    # tiny model: a user who likes short answers. The tiny model needs a big step (see test_trainer).
    monkeypatch.delenv("RLFLEET_HOME", raising=False)
    rater = tmp_path / "rater.py"
    rater.write_text("def short(prompt, answer):\n    return 1 if len(answer) < 30 else -1\n")
    with one_torch_thread():
        code = main([
            "--model", str(tiny_model_dir), "--rater", f"{rater}:short", "--ratings", "16", "--threshold", "8",
            "--lr", "3e-3", "--steps", "8", "--preset", "aggressive", "--heldout", "4", "--samples", "4",
            "--device", "cpu", "--home", str(tmp_path / "bench"), "--json",
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
