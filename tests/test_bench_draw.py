"""bench/draw.py and bench/draw_mlx.py on the tiny offline model: each way draws and is reported, the
model's decoder is put back afterwards, and RESULTS.md is left alone with --no-record. No timing is
asserted."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench import draw, record  # noqa: E402


def test_draw_reports_each_way_on_the_base_and_in_a_session(tiny_model_dir, capsys, single_thread):
    from rlfleet.worker.training import torch_backend

    decoder = torch_backend._decoder
    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = draw.main(["--model", str(tiny_model_dir), "--rows", "4", "--new-tokens", "4", "--rounds", "1",
                     "--threads", "1", "--json", "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before  # --no-record
    assert torch_backend._decoder is decoder  # the "generate" way's stand-in is gone
    # The tiny model is no GGUF file: llama.cpp cannot draw it, and the table says so by leaving it out.
    assert set(fig["ways"]) == {f"{w}/{way}" for w in ("base", "session") for way in ("decoding", "generate")}
    assert all(tps > 0 for tps in fig["ways"].values())
    assert fig["rows"] == 4 and fig["new_tokens"] == 4 and fig["draw_precision"] == "fp32"  # too narrow for bf16


def test_draw_refuses_nothing_to_draw(tiny_model_dir):
    with pytest.raises(SystemExit):
        draw.main(["--model", str(tiny_model_dir), "--rows", "0", "--no-record"])


def test_draw_mlx_reports_each_way(tiny_model_dir, capsys):
    pytest.importorskip("mlx.core", exc_type=ImportError, reason="bench.draw_mlx needs mlx: pip install -e '.[mlx]'")
    pytest.importorskip("mlx_lm", exc_type=ImportError, reason="bench.draw_mlx needs mlx-lm: pip install -e '.[mlx]'")
    from bench import draw_mlx

    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = draw_mlx.main(["--model", str(tiny_model_dir), "--rows", "3", "--new-tokens", "3", "--rounds", "1",
                         "--json", "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before
    assert set(fig["ways"]) == set(draw_mlx.WAYS) and all(tps > 0 for tps in fig["ways"].values())
    with pytest.raises(SystemExit):
        draw_mlx.main(["--model", str(tiny_model_dir), "--new-tokens", "0", "--no-record"])
