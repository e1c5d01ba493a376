"""bench.explore_passes on the tiny model: both ways run over the same answers and give the same figures."""

from __future__ import annotations

import json

from bench import explore_passes


def test_explore_passes_times_both_ways_over_the_same_answers(tiny_model_dir, capsys, single_thread):
    fig = explore_passes.main(["--model", str(tiny_model_dir), "--prompts", "2", "--answers", "3", "--rounds", "1",
                               "--threads", "1", "--json", "--no-record"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == fig
    assert fig["answers"] == 6 and fig["rounds"] == 1 and fig["endings"] >= 0
    assert fig["rows_seconds"] > 0 and fig["shared_seconds"] > 0
    assert fig["speedup"] == fig["rows_seconds"] / fig["shared_seconds"]
    # what a run sees does not depend on the way: the same features and log-probs
    assert fig["max_feature_difference"] < 1e-4 and fig["max_logprob_difference"] < 1e-4
