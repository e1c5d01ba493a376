"""bench/scopes.py on the tiny offline model: its figures are the responder's own, and add up. No timing
is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from bench import record  # noqa: E402
from bench import scopes as bench_scopes  # noqa: E402


def test_scopes_bench_loads_switches_and_answers_per_scope(tiny_model_dir, capsys, single_thread):
    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = bench_scopes.main(["--model", str(tiny_model_dir), "--scopes", "5", "--loaded", "2", "--rank", "2",
                             "--requests", "2", "--new-tokens", "2", "--threads", "1", "--neighbours", "2", "--json",
                             "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before  # --no-record
    assert fig["scopes"] == 5 and fig["loaded"] == 2 and fig["adapter_file_mib"] > 0
    assert 0 < fig["switch_loaded_ms_median"] <= fig["switch_loaded_ms_max"]
    assert 0 < fig["switch_disk_ms_median"] <= fig["switch_disk_ms_max"]
    assert fig["spread_ratio"] == pytest.approx(fig["aps_spread"] / fig["aps_one_scope"])
    # the queue takes scopes in turn: a quiet scope waits behind one run of each busy neighbour, never more
    assert fig["queue_runs_ahead"] == [2, 2, 2] and fig["queue_runs_ahead_max"] == 2


def test_scopes_bench_needs_more_scopes_than_it_keeps_loaded(tiny_model_dir):
    with pytest.raises(SystemExit):
        bench_scopes.main(["--model", str(tiny_model_dir), "--scopes", "2", "--loaded", "2", "--no-record"])
