"""bench/first_load.py refuses a model that has no GGUF file to copy (its figures need the default model,
about a minute: run on demand, bench/RESULTS.md)."""

from __future__ import annotations

import pytest

from bench import first_load


def test_a_model_without_a_gguf_file_is_a_usage_error(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exc:
        first_load.main(["--model", str(tiny_model_dir), "--no-record"])
    assert exc.value.code == 2
    assert "is not a GGUF model" in capsys.readouterr().err
