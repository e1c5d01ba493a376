"""Where a GGUF model's dequantised copy is kept, and how it is written (shared/gguf_copy.py); the copy
of the default model itself is loaded in tests/test_default_model.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlfleet.shared.gguf_copy import cache_root, copy_folder, default_root, is_model_folder, write_copy


def fill(folder: Path, marker: str = "a") -> None:
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_text(marker)


def test_the_cache_is_where_the_variables_say_and_can_be_turned_off(monkeypatch, tmp_path):
    monkeypatch.delenv("RLFLEET_MODEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == default_root() == tmp_path / "xdg" / "rlfleet" / "hf"
    monkeypatch.setenv("RLFLEET_MODEL_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    for off in ("off", "0", "false", "NO"):
        monkeypatch.setenv("RLFLEET_MODEL_CACHE", off)
        assert cache_root() is None


def test_a_changed_gguf_gets_a_copy_of_its_own(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF one")
    first = copy_folder(gguf, "m", tmp_path / "cache")
    assert first == copy_folder(gguf, "m", tmp_path / "cache") and first.name.startswith("m-")
    gguf.write_bytes(b"GGUF two, longer")
    assert copy_folder(gguf, "m", tmp_path / "cache") != first
    assert copy_folder(tmp_path / "other.gguf", "m", tmp_path / "cache") != first


def test_a_copy_appears_whole_or_not_at_all(tmp_path):
    dest = tmp_path / "cache" / "m-1234"

    def crash(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_copy(dest, crash)
    assert not dest.exists() and os.listdir(dest.parent) == []  # nothing half-written left behind

    assert write_copy(dest, fill) == dest and is_model_folder(dest)
    # a second process that converted at the same time: the copy already there is kept
    assert write_copy(dest, lambda folder: fill(folder, "b")) == dest
    assert (dest / "model.safetensors").read_text() == "a" and sorted(os.listdir(dest.parent)) == ["m-1234"]


def test_a_new_copy_of_a_changed_gguf_removes_the_copies_of_its_earlier_contents_only(tmp_path):
    root = tmp_path / "cache"
    gguf, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    gguf.write_bytes(b"GGUF one")
    other.write_bytes(b"GGUF other")
    first = write_copy(copy_folder(gguf, "m", root), fill, gguf)
    theirs = write_copy(copy_folder(other, "m", root), fill, other)
    unmarked = root / "m-unmarked"  # a copy from before copies named their source: left alone
    unmarked.mkdir()
    fill(unmarked)
    gguf.write_bytes(b"GGUF two, longer")
    second = write_copy(copy_folder(gguf, "m", root), fill, gguf)
    assert second != first and is_model_folder(second) and not first.exists()
    assert is_model_folder(theirs) and is_model_folder(unmarked)
    assert sorted(p.name for p in root.iterdir()) == sorted([second.name, theirs.name, "m-unmarked"])


def test_within_a_gguf_load_each_name_map_is_built_once_and_the_module_is_put_back():
    import gguf

    from rlfleet.shared.models import gguf_parsed_once

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 4)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 4) is first  # built once
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 5) is not first  # per depth
        assert first.get_name("model.layers.3.self_attn.q_proj") == name_map(gguf.MODEL_ARCH.LLAMA, 4).get_name(
            "model.layers.3.self_attn.q_proj")
        memo = gguf.GGUFReader
        with gguf_parsed_once():  # a load inside a load keeps the outer memos (and does not wait on itself)
            assert gguf.GGUFReader is memo
        assert gguf.GGUFReader is memo
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    try:
        with gguf_parsed_once():
            raise RuntimeError("a load that fails")
    except RuntimeError:
        pass
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
