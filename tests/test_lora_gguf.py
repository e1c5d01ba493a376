"""A PEFT LoRA adapter as llama.cpp's LoRA GGUF (shared/lora_gguf.py): names, scaling, row order, and
what is refused. tests/test_llamacpp_engine.py shows llama.cpp applying the result as peft does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.shared.lora_gguf import BaseShape, LoraConversionError, gguf_tensors, permute_rows, write_lora_gguf


def _peft_folder(tmp: Path, config: dict, state: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
    return tmp


def test_permutation_is_the_one_transformers_undoes_when_it_reads_a_gguf():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    undo = LlamaTensorProcessor()._reverse_permute_weights
    assert np.array_equal(undo(permute_rows(w, 3), 3, 3), w)
    assert np.array_equal(undo(permute_rows(w, 2), 6, 2), w)  # keys: the kv heads' count
    assert not np.array_equal(permute_rows(w, 3), w)


def test_peft_pairs_become_gguf_names_with_peft_scaling_in_b_and_permuted_query_key_rows(tmp_path):
    r, hidden, heads, kv = 4, 16, 4, 2
    state, want = {}, {}
    for mod, out in [("self_attn.q_proj", hidden), ("self_attn.k_proj", hidden // 2), ("mlp.down_proj", hidden)]:
        a, b = torch.randn(r, hidden), torch.randn(out, r)
        state[f"base_model.model.model.layers.1.{mod}.lora_A.weight"] = a
        state[f"base_model.model.model.layers.1.{mod}.lora_B.weight"] = b
        want[mod] = (a, b)
    folder = _peft_folder(tmp_path / "a", {"r": r, "lora_alpha": 8, "alpha_pattern": {"down_proj": 2}}, state)
    got = dict(gguf_tensors(folder, BaseShape("llama", 2, heads, kv)))
    assert set(got) == {f"blk.1.{n}.weight.lora_{p}" for n in ("attn_q", "attn_k", "ffn_down") for p in "ab"}
    a, b = want["self_attn.q_proj"]
    assert np.allclose(got["blk.1.attn_q.weight.lora_a"], a.numpy())
    assert np.allclose(got["blk.1.attn_q.weight.lora_b"], permute_rows(b.numpy() * 2.0, heads))  # 8 / 4
    a, b = want["self_attn.k_proj"]
    assert np.allclose(got["blk.1.attn_k.weight.lora_b"], permute_rows(b.numpy() * 2.0, kv))
    a, b = want["mlp.down_proj"]
    assert np.allclose(got["blk.1.ffn_down.weight.lora_b"], b.numpy() * 0.5)  # its own alpha 2 / 4
    rs = dict(gguf_tensors(_peft_folder(tmp_path / "rs", {"r": r, "lora_alpha": 8, "use_rslora": True}, state),
                           BaseShape("qwen2", 2, heads, kv)))
    assert np.allclose(rs["blk.1.attn_q.weight.lora_b"], want["self_attn.q_proj"][1].numpy() * 4.0)  # 8/sqrt(4),
    # and no permutation for an architecture whose converter keeps Hugging Face's rows


def test_what_llama_cpp_cannot_take_is_refused_before_a_file_is_written(tmp_path):
    ok = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
          "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2)}
    shape = BaseShape("llama", 1, 2, 2)
    cases = {
        "dora": ({"r": 2, "use_dora": True}, ok),
        "half a pair": ({"r": 2}, {k: v for k, v in ok.items() if "lora_A" in k}),
        "output layer": ({"r": 2}, {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 8),
                                    "base_model.model.lm_head.lora_B.weight": torch.zeros(8, 2)}),
        "not lora": ({"r": 2}, {"base_model.model.model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}),
    }
    for name, (config, state) in cases.items():
        folder = _peft_folder(tmp_path / name.replace(" ", "-"), config, state)
        with pytest.raises(LoraConversionError):
            list(gguf_tensors(folder, shape))
    with pytest.raises(LoraConversionError, match="architecture"):
        list(gguf_tensors(_peft_folder(tmp_path / "arch", {"r": 2}, ok), BaseShape("no-such-arch", 1, 2, 2)))


def test_the_file_is_an_adapter_gguf_of_the_base_architecture(tmp_path):
    from gguf import GGUFReader

    state = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.randn(2, 8),
             "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": torch.randn(12, 2)}
    folder = _peft_folder(tmp_path / "a", {"r": 2, "lora_alpha": 2}, state)
    path = write_lora_gguf(folder, tmp_path / "unused.gguf", tmp_path / "out" / "a.gguf", BaseShape("llama", 1, 2, 2))
    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields["general.type"] == "adapter" and fields["adapter.type"] == "lora"
    assert fields["general.architecture"] == "llama" and fields["adapter.lora.alpha"] == 0.0
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in reader.tensors}
    assert shapes == {"blk.0.ffn_up.weight.lora_a": (8, 2), "blk.0.ffn_up.weight.lora_b": (2, 12)}  # ggml order


def test_the_base_shape_is_read_from_metadata_values_and_a_missing_or_odd_one_is_said():
    fields = {"general.architecture": "llama", "llama.block_count": "30", "llama.attention.head_count": 9,
              "llama.attention.head_count_kv": "3"}
    assert BaseShape.read(fields.get, "m.gguf") == BaseShape("llama", 30, 9, 3)
    no_kv = {k: v for k, v in fields.items() if not k.endswith("_kv")}
    assert BaseShape.read(no_kv.get, "m.gguf") == BaseShape("llama", 30, 9, 9)  # no grouped keys: one per head
    with pytest.raises(LoraConversionError, match="m.gguf has no llama.block_count"):
        BaseShape.read({k: v for k, v in fields.items() if k != "llama.block_count"}.get, "m.gguf")
    with pytest.raises(LoraConversionError, match="llama.attention.head_count is \\[9, 9, 6\\], not one number"):
        BaseShape.read({**fields, "llama.attention.head_count": [9, 9, 6]}.get, "m.gguf")
