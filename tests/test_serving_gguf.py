"""The GGUF file llama.cpp serves (shared/serving_gguf.py): the default model's Q4_1 weights, a type
llama.cpp multiplies one token at a time, are served from a Q8_0 copy made once in the model cache;
a file in a type it batches, or no cache, is served as it is. That the copy answers as the torch
model does is tests/test_llamacpp_engine.py's (its engine reads this copy)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from rlfleet.shared import serving_gguf  # noqa: E402
from rlfleet.shared.gguf_copy import SOURCE  # noqa: E402
from rlfleet.shared.models import resolve_model  # noqa: E402


@pytest.fixture(scope="module")
def gguf() -> Path:
    ref = resolve_model("smollm2-135m")
    return Path(ref.path) / str(ref.gguf_file)


def test_a_q4_1_file_is_served_from_a_q8_0_copy_made_once(gguf, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLFLEET_MODEL_CACHE", str(tmp_path))
    assert serving_gguf.weight_type(gguf) == "Q4_1"
    with caplog.at_level(logging.INFO, logger="rlfleet.shared.serving_gguf"):
        served = serving_gguf.served_file(gguf)
    assert served != gguf and served.is_relative_to(tmp_path / "llamacpp")
    assert serving_gguf.weight_type(served) == "Q8_0"
    assert (served.parent / SOURCE).read_text() == str(gguf.resolve())
    assert "Q8_0 copy" in caplog.text
    made = served.stat().st_mtime_ns
    assert serving_gguf.served_file(gguf) == served and served.stat().st_mtime_ns == made  # not made again
    # A file llama.cpp batches already (the copy itself) is served as it is, its types read once.
    assert serving_gguf.served_file(served) == served
    monkeypatch.setattr(serving_gguf, "weight_type", lambda _p: pytest.fail("the types were read again"))
    assert serving_gguf.served_file(served) == served
    assert serving_gguf.served_file(gguf) == served
    kept = sorted(p.name for p in (tmp_path / "llamacpp").iterdir())  # no temporary left
    assert len(kept) == 2 and served.parent.name in kept
    assert [k for k in kept if k.endswith(serving_gguf.AS_IS)] == [k for k in kept if k != served.parent.name]


def test_without_a_cache_or_a_writable_one_the_file_itself_is_served(gguf, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLFLEET_MODEL_CACHE", "off")
    assert serving_gguf.served_file(gguf) == gguf
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder would be")
    monkeypatch.setenv("RLFLEET_MODEL_CACHE", str(blocked))
    with caplog.at_level(logging.WARNING, logger="rlfleet.shared.serving_gguf"):
        assert serving_gguf.served_file(gguf) == gguf
    assert "could not be written" in caplog.text
