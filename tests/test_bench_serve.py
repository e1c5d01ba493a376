"""bench/serve.py runs `rlfleet serve` on the tiny offline model (llama.cpp is not installed here: ours
alone) and reports figures that add up to the requests it actually sent. No timing is asserted."""

from __future__ import annotations

import json
import statistics
import sys

import pytest

pytest.importorskip("torch")

from bench import record  # noqa: E402
from bench import serve as bench_serve  # noqa: E402


def test_serve_bench_counts_what_it_sent(tiny_model_dir, capsys):
    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = bench_serve.main(["--model", str(tiny_model_dir), "--servers", "rlfleet", "--threads", "1",
                            "--rounds", "1", "--prompts", "4", "--clients", "1,4,16", "--per-client", "2",
                            "--max-tokens", "8", "--start-timeout", "120", "--json", "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))  # --json: one object on stdout
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before  # --no-record

    phases = {r["kind"]: r for r in fig["results"]}
    assert [r["server"] for r in fig["results"]] == ["rlfleet"] * 5
    assert set(phases) == {"single", "ttft", "c1", "c4", "c16"}
    for kind, clients in (("single", 1), ("ttft", 1), ("c1", 1), ("c4", 4), ("c16", 16)):
        p = phases[kind]
        sent = 4 if kind in ("single", "ttft") else clients * 2
        assert p["clients"] == clients and p["answers"] == sent
        assert p["answers"] <= p["tokens"] <= 8 * p["answers"]  # usage.completion_tokens, capped by max_tokens
        assert p["answers_per_s"] == pytest.approx(p["answers"] / p["wall_s"])
        assert p["tokens_per_s"] == pytest.approx(p["tokens"] / p["wall_s"])

    single = phases["single"]
    assert fig["rlfleet_tps"] == pytest.approx(single["tokens"] / single["wall_s"]) and fig["rlfleet_tps"] > 0
    assert fig["rlfleet_tokens_per_answer"] == pytest.approx(single["tokens"] / 4)
    for c in (1, 4, 16):
        assert fig[f"rlfleet_aps{c}"] == pytest.approx(phases[f"c{c}"]["answers_per_s"]) and fig[f"rlfleet_aps{c}"] > 0
        assert fig[f"llamacpp_aps{c}"] is None and fig[f"aps{c}_ratio"] is None
    assert fig["llamacpp_tps"] is None and fig["tps_ratio"] is None

    ttft = phases["ttft"]  # the first content chunk comes before the answer ends, and TTFT is their median
    assert all(0 < f <= a for f, a in zip(ttft["ttft_all_s"], ttft["answer_s"], strict=False))
    assert fig["rlfleet_ttft_s"] == ttft["ttft_s"] == statistics.median(ttft["ttft_all_s"])
    assert sum(ttft["answer_s"]) <= ttft["wall_s"]
    assert fig["load_s"]["rlfleet"] > 0


def test_serve_bench_says_what_went_wrong(tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="no llama.cpp venv at .*--servers rlfleet"):
        bench_serve.main(["--model", str(tiny_model_dir), "--llamacpp-python", str(tmp_path / "python"),
                          "--no-record"])
    with pytest.raises(SystemExit, match="serves GGUF files only"):
        bench_serve.main(["--model", str(tiny_model_dir), "--llamacpp-python", sys.executable, "--no-record"])
    with pytest.raises(SystemExit, match=r"rlfleet serve exited with \d+ while starting; the end of its log:\n"
                                         r"(.|\n)*does not exist"):
        bench_serve.main(["--model", str(tmp_path / "no-such-model"), "--servers", "rlfleet", "--no-record"])
