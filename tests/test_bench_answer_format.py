"""bench/answer_format.py: its counts from hand-written answers, and one small run on the tiny model,
where every prefixed answer carries the prefix and nothing is recorded."""

from __future__ import annotations

import pytest

from bench import answer_format, record
from bench.gym_llamagym import BlackjackPrompts


def test_the_three_counts_read_answers_as_each_parser_does():
    answers = [
        "Action: 1",  # readable, a hit
        "Action: 0.",  # readable, a stay
        "Action: 17",  # the model repeating its sum: not an action, but LlamaGym's parser reads its "1"
        "Action: 1Finally",  # no word boundary after the digit: not readable, a hit to LlamaGym
        "I would hit here.",  # prose: no marker, LlamaGym reads the word "hit"
        "Let me think about it.",  # prose it cannot read: a stay
    ]
    got = answer_format.tally(answers, BlackjackPrompts().extract_action)
    assert got == {"answers": 6, "action_marker": 4, "readable": 2, "hits": 4}


def test_sums_must_be_a_list_of_player_sums():
    assert answer_format.parse_sums("8, 12,20") == [8, 12, 20]
    for bad in ("", "3", "22", "8,x"):
        with pytest.raises(ValueError):
            answer_format.parse_sums(bad)


def test_bad_options_are_usage_errors():
    for argv in (["--samples", "0"], ["--dealer", "11"], ["--prefix", " "], ["--sums", "30"], ["--top-p", "0"]):
        with pytest.raises(SystemExit) as exc:
            answer_format.main([*argv, "--no-record"])
        assert exc.value.code == 2


def test_a_run_on_the_tiny_model_draws_both_variants_and_records_nothing(tiny_model_dir, single_thread):
    before = record.RESULTS.read_text()
    figures = answer_format.main(["--model", str(tiny_model_dir), "--samples", "3", "--sums", "9,19",
                                  "--tokens-without", "6", "--tokens-with", "2", "--json", "--no-record"])
    without, prefixed = figures["variants"]["none"], figures["variants"]["Action:"]
    assert without["prefix"] == "" and without["max_new_tokens"] == 6
    for v in (without, prefixed):
        assert v["answers"] == 6 and set(v["by_sum"]) == {"9", "19"}
        assert sum(h["answers"] for h in v["by_sum"].values()) == 6
        assert v["readable"] <= v["action_marker"]
    # The prefix is written for the model: every answer of that variant starts with it.
    assert prefixed["action_marker"] == 6
    assert all(h["example"].startswith("Action:") for h in prefixed["by_sum"].values())
    assert record.RESULTS.read_text() == before
