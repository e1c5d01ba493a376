"""bench/gate_noise.py runs end to end on the tiny offline model: one row per size, `--draws` readings in
each, figures that add up, and a different seed per reading. No figure of the real model is asserted."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from bench import gate_noise

RESULTS = Path(gate_noise.__file__).with_name("RESULTS.md")


def _digest() -> str | None:
    return hashlib.sha256(RESULTS.read_bytes()).hexdigest() if RESULTS.exists() else None


def test_reads_the_same_model_several_times_per_size(tiny_model_dir, single_thread, capsys, monkeypatch):
    from rlfleet.worker.training.torch_backend import Trainer

    sampled: list[tuple[int, int, list[list[int]]]] = []  # (answers, seed, token lists) of each reading
    real = Trainer.sample

    def recording(self, prompts, max_new_tokens, seed, temperature=0.7, top_p=1.0, seeds=None):
        out = real(self, prompts, max_new_tokens, seed, temperature, top_p, seeds)
        sampled.append((len(prompts), seed, out))
        return out

    monkeypatch.setattr(Trainer, "sample", recording)
    before = _digest()
    figures = gate_noise.main(["--model", str(tiny_model_dir), "--sizes", "4,2", "--draws", "3", "--new-tokens", "8",
                               "--device", "cpu", "--seed", "5", "--json", "--no-record"])
    assert _digest() == before  # --no-record: RESULTS.md untouched
    out = json.loads(capsys.readouterr().out)
    assert out == figures
    assert out["device"] == "cpu" and out["bound"] == 0.03 and out["new_tokens"] == 8
    rows = out["rows"]
    assert [r["answers"] for r in rows] == [2, 4]  # sorted, smallest first
    for r in rows:
        assert r["draws"] == 3 and len(r["readings"]) == 3
        assert all(0.0 <= x <= 1.0 for x in r["readings"])
        assert r["min"] <= r["mean"] <= r["max"]
        assert r["largest_gap"] == pytest.approx(r["max"] - r["min"])
        assert 0.0 <= r["pairs_over_bound"] <= 1.0 and r["std"] >= 0.0
        assert 0 < r["answer_tokens"] <= 8
    if rows[-1]["std"] > 0:
        assert out["std_ratio"] == pytest.approx(rows[0]["std"] / rows[-1]["std"])
    else:
        assert out["std_ratio"] is None

    # One batched sample per reading, of `answers` prompts, each with its own seed (base + 1000·n + d).
    assert [(n, seed) for n, seed, _ in sampled] == [(n, 5 + 1000 * n + d) for n in (2, 4) for d in range(3)]
    if any(len(set(r["readings"])) > 1 for r in rows):
        return  # the readings themselves differ between seeds
    # The tiny random model repeats no trigram in 8 tokens (every reading 0): the answers must differ.
    for n in (2, 4):
        draws = [tokens for size, _, tokens in sampled if size == n]
        assert all(len(t) == n for t in draws)
        assert len({json.dumps(t) for t in draws}) > 1, f"the {n}-answer readings drew the same answers"


def test_figures_of_known_readings():
    row = gate_noise.summarise(8, [0.0, 0.05, 0.01], [40.0, 48.0, 44.0], bound=0.03)
    assert row["mean"] == pytest.approx(0.02) and row["min"] == 0.0 and row["max"] == 0.05
    assert row["largest_gap"] == pytest.approx(0.05)
    assert row["pairs_over_bound"] == pytest.approx(2 / 3)  # 0.05 and 0.04 exceed 0.03; 0.01 does not
    assert row["std"] == pytest.approx(0.0264575, rel=1e-5)
    assert row["answer_tokens"] == pytest.approx(44.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "0"], "every size must be at least 1"),
        (["--sizes", "8,x"], "not a comma list of whole numbers"),
        (["--draws", "1"], "--draws must be between 2 and 1000"),
        (["--temperature", "0"], "--temperature must be above 0"),
    ],
)
def test_bad_options_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gate_noise.parse([*argv, "--no-record"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m bench.gate_noise" in err and message in err
