"""bench/engine_fidelity.py measures a data dir's served version as each engine draws it: the held-out
rate it reports is the preference's verdict on the very answers drawn (recounted here), and an engine
that cannot run on the model is a clean error, not a silent torch run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench import engine_fidelity  # noqa: E402
from bench.learning.metrics import preferred_rate  # noqa: E402
from bench.learning.raters import preference  # noqa: E402
from rlfleet.shared.config import Config  # noqa: E402
from rlfleet.shared.errors import ConfigError  # noqa: E402


def test_the_rate_is_the_preferences_verdict_on_the_drawn_answers(tiny_model_dir, tmp_path, monkeypatch):
    Config(home=tmp_path, model=str(tiny_model_dir)).save()
    drawn = []

    from rlfleet.shared.responder import LocalResponder

    original = LocalResponder.sample

    def recording(self, *a, **k):
        out = original(self, *a, **k)
        drawn.extend(out)
        return out

    monkeypatch.setattr(LocalResponder, "sample", recording)
    fig = engine_fidelity.main(["--home", str(tmp_path), "--preference", "short:5", "--heldout", "2",
                                "--samples", "3", "--batch", "4", "--max-new-tokens", "8", "--engines", "torch",
                                "--json", "--no-record"])
    torch_fig = fig["engines"]["torch"]
    assert (fig["answers"], torch_fig["drawn_by"], torch_fig["version"]) == (6, "torch", None)
    from bench.learning.simulate import heldout_prompts

    prompts = [p for p in heldout_prompts(2) for _ in range(3)]
    pref = preference("short:5")
    rate, ci, n = preferred_rate([pref.rate(p, a.text) for p, a in zip(prompts, drawn, strict=True)])
    assert (torch_fig["rate"], torch_fig["ci95"], torch_fig["judged"]) == (rate, list(ci), n)


@pytest.mark.parametrize("args", [
    ["--home", "{missing}", "--preference", "short:5"],
    ["--home", "{home}", "--preference", "no-such-taste"],
    ["--home", "{home}", "--preference", "short:5", "--engines", "vllm"],
    ["--home", "{home}", "--preference", "short:5", "--samples", "0"],
])
def test_bad_arguments_are_a_usage_error(tiny_model_dir, tmp_path, capsys, args):
    home = tmp_path / "home"
    Config(home=home, model=str(tiny_model_dir)).save()
    argv = [a.format(home=home, missing=tmp_path / "nowhere") for a in args]
    with pytest.raises(SystemExit) as exited:
        engine_fidelity.main([*argv, "--no-record"])
    assert exited.value.code == 2 and "error:" in capsys.readouterr().err


def test_llama_cpp_on_a_model_it_cannot_run_is_a_clean_error(tiny_model_dir, tmp_path):
    Config(home=tmp_path, model=str(tiny_model_dir)).save()
    with pytest.raises(ConfigError, match="llama.cpp"):
        engine_fidelity.main(["--home", str(tmp_path), "--preference", "short:5", "--heldout", "1",
                              "--samples", "1", "--engines", "llama.cpp", "--json", "--no-record"])
