"""bench/decode_cost.py on the tiny offline model: it counts the model's own linear layers and weight
bytes, and reports the share the products are of the forward. No timing is asserted."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from bench import decode_cost, record  # noqa: E402


def test_decode_cost_times_the_models_own_linear_layers(tiny_model_dir, capsys, single_thread):
    from rlfleet.shared.models import load_model, resolve_model

    before = record.RESULTS.read_text() if record.RESULTS.exists() else None
    fig = decode_cost.main(["--model", str(tiny_model_dir), "--threads", "1", "--repeat", "2", "--json",
                            "--no-record"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(fig))
    assert (record.RESULTS.read_text() if record.RESULTS.exists() else None) == before  # --no-record
    linears = [m for m in load_model(resolve_model(str(tiny_model_dir))).modules() if isinstance(m, torch.nn.Linear)]
    assert fig["linears"] == len(linears) > 0
    assert fig["weight_mb_fp32"] == pytest.approx(sum(m.weight.numel() * 4 for m in linears) / 1e6)
    assert fig["forward_ms"] > 0 and fig["linears_fp32_ms"] > 0 and fig["linears_bf16_ms"] > 0
    assert fig["linears_share"] == pytest.approx(fig["linears_fp32_ms"] / fig["forward_ms"])


def test_decode_cost_refuses_no_repeats(tiny_model_dir):
    with pytest.raises(SystemExit):
        decode_cost.main(["--model", str(tiny_model_dir), "--repeat", "0", "--no-record"])
