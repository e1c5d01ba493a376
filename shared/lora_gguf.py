"""A PEFT LoRA adapter as llama.cpp reads one: a GGUF file of ``general.type = adapter``.

llama.cpp applies a LoRA pair to the base tensor of the same GGUF name (``blk.3.attn_q.weight`` takes
``blk.3.attn_q.weight.lora_a`` and ``.lora_b``), A stored as PEFT stores it (rank x in), B as (out x
rank), scaled by ``alpha / rank`` or, when alpha is 0, by 1. Two things differ from PEFT's layout:

* names: PEFT names the Hugging Face module (``model.layers.3.self_attn.q_proj``); gguf's own tensor
  name map gives the GGUF name for the base file's architecture.
* row order: llama.cpp's converter permutes the rows of a llama-architecture model's query and key
  projections (its rope pairs adjacent dimensions, Hugging Face's pairs halves; transformers permutes
  them back when it reads a GGUF), so B's rows of those two are permuted the same way.

PEFT's scaling (``lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA, per-module ranks and alphas) is folded
into B and alpha written as 0, so every layer gets exactly PEFT's factor. An adapter this cannot map
(DoRA, an embedding or output-layer adapter, an unknown architecture or module) raises
:class:`LoraConversionError`; the caller answers with the torch model instead.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .registry import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LEGACY_WEIGHTS

# Architectures whose GGUF query/key rows llama.cpp's converter permutes (its LlamaModel.permute).
PERMUTED_ARCHS = frozenset({"llama"})
_MODULE = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class LoraConversionError(ValueError):
    """The adapter has a part llama.cpp cannot take as this converter maps it."""


@dataclass(frozen=True)
class BaseShape:
    """What the mapping needs of the base model, read from its GGUF file."""

    arch: str
    blocks: int
    heads: int
    kv_heads: int

    @classmethod
    def of(cls, gguf_path: Path) -> BaseShape:
        """From the file's metadata (a parse of every field: seconds on a CPU; a loaded llama.cpp model
        has them at hand, :meth:`read`)."""
        from gguf import GGUFReader

        fields = GGUFReader(str(gguf_path)).fields
        return cls.read(lambda key: fields[key].contents() if key in fields else None, str(gguf_path))

    @classmethod
    def read(cls, value: Callable[[str], Any], source: str) -> BaseShape:
        """From ``value(key)``, a GGUF metadata field's value (None: the file has no such field)."""

        def need(key: str) -> Any:
            v = value(key)
            if v is None:
                raise LoraConversionError(f"{source} has no {key}")
            return v

        def count(key: str, v: Any) -> int:
            try:
                return int(v)
            except (TypeError, ValueError):  # a per-layer list: a shape this mapping does not know
                raise LoraConversionError(f"{source}'s {key} is {str(v)[:80]}, not one number") from None

        arch = str(need("general.architecture"))
        heads_key, kv_key, blocks_key = (f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv",
                                         f"{arch}.block_count")
        heads = count(heads_key, need(heads_key))
        kv = value(kv_key)
        return cls(arch, count(blocks_key, need(blocks_key)), heads, count(kv_key, kv) if kv is not None else heads)


def permute_rows(weight: Any, heads: int) -> Any:
    """llama.cpp's converter's row order of a query/key projection with ``heads`` heads: each head's
    first and second halves interleaved."""
    out = weight.shape[0]
    return weight.reshape(heads, 2, out // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's factor for ``module``'s pair (its rank/alpha patterns match a module by name suffix)."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.search(rf"(^|\.){pattern}$", module):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _read_state(folder: Path) -> dict[str, Any]:
    import torch

    if (folder / ADAPTER_WEIGHTS).is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / ADAPTER_WEIGHTS))
    if (folder / LEGACY_WEIGHTS).is_file():
        return torch.load(str(folder / LEGACY_WEIGHTS), map_location="cpu", weights_only=True)
    raise LoraConversionError(f"{folder} holds no adapter weights")


def gguf_tensors(folder: Path, base: BaseShape) -> Iterator[tuple[str, Any]]:
    """``(GGUF name, float32 array)`` for each LoRA tensor of the PEFT adapter in ``folder``."""
    import gguf
    import torch

    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraConversionError(f"{config.get('peft_type')} adapters are not LoRA")
    if config.get("use_dora"):
        raise LoraConversionError("DoRA adapters have no llama.cpp form")
    arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(base.arch)
    if arch is None:
        raise LoraConversionError(f"gguf does not know the architecture {base.arch!r}")
    names = gguf.get_tensor_name_map(arch, base.blocks)

    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in _read_state(folder).items():
        m = _MODULE.match(key)
        if m is None:
            raise LoraConversionError(f"{key} is not a LoRA A/B weight")
        pairs.setdefault(m["module"], {})[m["part"]] = tensor
    if not pairs:
        raise LoraConversionError(f"{folder} holds no LoRA weights")
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraConversionError(f"{module} has lora_{''.join(pair)} only")
        target = names.get_name(module)
        if target is None or target in ("token_embd", "output"):
            raise LoraConversionError(f"{module} has no llama.cpp LoRA form ({target or 'unmapped'})")
        a, b = pair["A"].to(torch.float32), pair["B"].to(torch.float32)
        b = b * _scaling(config, module, a.shape[0])
        if base.arch in PERMUTED_ARCHS and target.endswith(("attn_q", "attn_k")):
            b = permute_rows(b, base.heads if target.endswith("attn_q") else base.kv_heads)
        yield f"{target}.weight.lora_a", a.contiguous().numpy()
        yield f"{target}.weight.lora_b", b.contiguous().numpy()


def write_lora_gguf(folder: Path, base_gguf: Path, dest: Path, base: BaseShape | None = None) -> Path:
    """Write the PEFT adapter in ``folder`` as a llama.cpp LoRA GGUF for the model in ``base_gguf``."""
    import gguf

    base = base or BaseShape.of(base_gguf)
    tensors = list(gguf_tensors(folder, base))  # all of them mapped before a byte is written
    dest.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(dest), base.arch)
    try:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 0.0)  # PEFT's scaling is in B already
        for name, array in tensors:
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return dest
