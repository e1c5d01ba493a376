"""bench/turns.py on the tiny offline model: both sides answer the same turns, and the token counts
add up to the conversations it played. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import record  # noqa: E402
from bench import turns as bench_turns  # noqa: E402


def test_turns_bench_compares_the_same_answers_and_counts_the_tokens_the_cache_held(tiny_model_dir, capsys,
                                                                                  single_thread):
    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = bench_turns.main(["--model", str(tiny_model_dir), "--episodes", "2", "--turns", "3", "--new-tokens", "4",
                            "--threads", "1", "--device", "cpu", "--json", "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before  # --no-record
    assert fig["answers"] == 6 and fig["same_answers"] == 6 and fig["max_logprob_gap"] < 1e-3
    assert fig["reused_tokens"] + fig["encoded_tokens"] == fig["prompt_tokens"]
    assert 0 < fig["reused_tokens"] < fig["prompt_tokens"]  # turns 2 and 3 of each episode
    assert [t["turn"] for t in fig["per_turn"]] == [1, 2, 3]
    assert fig["speedup"] == pytest.approx(fig["plain_s"] / fig["cached_s"])


def test_turns_bench_refuses_a_conversation_too_short_to_reuse(tiny_model_dir):
    with pytest.raises(SystemExit):
        bench_turns.main(["--model", str(tiny_model_dir), "--turns", "1", "--no-record"])
