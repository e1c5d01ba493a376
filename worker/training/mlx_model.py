"""The files the MLX backend reads and writes: the Hugging Face folder it loads, the peft adapter.

- The model is loaded by mlx_lm from a Hugging Face folder with safetensors weights. A GGUF model
  (the default model is one) or a folder without safetensors is first converted once, with
  transformers, into a cache folder (``~/.cache/rlfleet/hf/<slug>-<hash>``, the one the torch loader
  keeps a GGUF's dequantised copy in), written to a temporary folder and renamed into place.
- Adapters are plain peft adapters (``adapter_config.json`` + ``adapter_model.safetensors`` with
  peft's key names and shapes), so the registry keeps one format: an MLX-trained version is served
  by the torch responder, exported, and continued by either backend. peft's ``lora_A.weight`` is
  ``(r, in)`` and ``lora_B.weight`` ``(out, r)``; here they are numpy arrays in peft's layout.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.shared.errors import ModelUnavailable
from rlfleet.shared.gguf_copy import cache_root, copy_folder, default_root, is_model_folder, write_copy
from rlfleet.shared.models import ModelRef, ordered_ids, save_model_folder
from rlfleet.shared.registry import ADAPTER_CONFIG, ADAPTER_WEIGHTS

INSTALL_HINT = "pip install -e '.[mlx]'"
PEFT_PREFIX = "base_model.model."


def require_mlx() -> None:
    """Raise :class:`ModelUnavailable` with the install command when mlx or mlx_lm is missing."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailable(
            f"train.device = 'mlx' needs mlx and mlx-lm ({exc}); run: {INSTALL_HINT}"
        ) from None


def hf_folder(ref: ModelRef, cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder with safetensors weights that mlx_lm can load for ``ref``.

    A local folder that already is one is used as is; a hub id already in the Hugging Face cache
    is used from there; anything else (a GGUF file, ``.bin`` weights, a hub id not cached) is
    loaded once with transformers in fp32 and saved into ``cache_dir`` (default: the cache the torch
    loader keeps a GGUF's dequantised copy in, :mod:`rlfleet.shared.gguf_copy`; written atomically, so
    a crash or a concurrent conversion never leaves half a model).
    """
    if ref.gguf_file is None:
        local = Path(ref.path)
        if local.is_dir():
            if is_model_folder(local):
                return local
        else:
            with contextlib.suppress(Exception):
                from huggingface_hub import snapshot_download

                cached = Path(snapshot_download(ref.path, local_files_only=True))
                if is_model_folder(cached):
                    return cached
    root = Path(cache_dir) if cache_dir else (cache_root() or default_root())
    dest = copy_folder(Path(ref.path) / (ref.gguf_file or ""), ref.slug, root)
    if is_model_folder(dest):
        return dest
    return write_copy(dest, lambda tmp: save_model_folder(ref, tmp), Path(ref.path) / (ref.gguf_file or ""))


def end_ids(folder: Path, config: dict, tokenizer: Any) -> list[int]:
    """The ids that end an answer, as :func:`rlfleet.shared.models.end_token_ids` reads them from a
    torch model: the tokenizer's end token, then the folder's generation config's (transformers falls
    back on the model config's where the folder has none)."""
    path = folder / "generation_config.json"
    generation = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else config
    return ordered_ids(tokenizer.eos_token_id, generation.get("eos_token_id"))


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the Hugging Face checkpoint in ``folder`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


def legacy_rope_fields(config: dict) -> dict:
    """``rope_theta`` / ``rope_scaling`` from transformers 5's ``rope_parameters``, for mlx_lm.

    transformers 5 saves a model's RoPE settings as ``rope_parameters`` (its GGUF conversion of the
    default model too); many mlx_lm architectures (llama among them) still read only the older
    top-level fields and would silently fall back to ``rope_theta = 10000``. Only the flat form is
    translated (per-layer-type parameters are left to the architectures that read them)."""
    rope = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    extra = {k: v for k, v in rope.items() if k != "rope_theta"}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if extra.get("rope_type", extra.get("type", "default")) != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = extra
    return out



@dataclass
class LoraSpec:
    rank: int
    alpha: float
    paths: list[str]  # module paths, the same in mlx_lm and in the Hugging Face model
    scale: float
    config: dict | None = None  # a parent's adapter_config.json, kept for the child
    weights: dict[str, Any] | None = None  # peft key -> numpy array


def fresh_spec(rank: int, alpha: float, targets: list[str]) -> LoraSpec:
    return LoraSpec(rank, alpha, list(targets), alpha / rank)


def read_adapter(adapter_dir: Path, targets: list[str], model_spec: str) -> LoraSpec:
    """A parent adapter's shape and weights, checked against the modules it may target."""
    from safetensors.numpy import load_file

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ValueError(f"adapter {adapter_dir} is not a plain LoRA; the mlx trainer cannot continue it")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"adapter {adapter_dir} has per-module ranks; the mlx trainer cannot continue it")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    paths = sorted({k[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for k in weights if ".lora_" in k})
    known = set(targets)
    unexpected = [k for k in weights if not _peft_key_ok(k, known)]
    missing = [f"{p}.lora_{w}" for p in paths for w in "AB" if peft_key(p, w) not in weights]
    if unexpected or missing or not paths:
        raise ValueError(
            f"adapter {adapter_dir} does not fit {model_spec}: "
            f"unexpected {unexpected[:3]}, missing {missing[:3]}"
        )
    return LoraSpec(rank, alpha, paths, scale, config=config, weights=weights)


def write_adapter(out_dir: Path, spec: LoraSpec, tensors: dict[str, Any], base: str) -> None:
    """Write a peft adapter folder: ``tensors`` (peft key -> numpy array) and the config, the
    parent's when there is one (a lineage keeps its shape)."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = dict(spec.config) if spec.config is not None else _lora_config(spec.rank, spec.alpha, spec.paths, base)
    config["inference_mode"] = True
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")



def peft_key(path: str, which: str) -> str:
    return f"{PEFT_PREFIX}{path}.lora_{which}.weight"


def _peft_key_ok(key: str, known: set[str]) -> bool:
    if not key.startswith(PEFT_PREFIX):
        return False
    for which in "AB":
        suffix = f".lora_{which}.weight"
        if key.endswith(suffix):
            return key[len(PEFT_PREFIX) : -len(suffix)] in known
    return False


def _lora_config(rank: int, alpha: float, paths: list[str], base: str) -> dict:
    """peft's LoraConfig for these modules, as ``adapter_config.json`` holds it."""
    try:
        from peft import LoraConfig
    except ImportError:  # the fields peft needs to load it
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": list(paths),
            "base_model_name_or_path": base,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }
    lora = LoraConfig(
        r=rank,
        # peft annotates lora_alpha int; it takes any number (its scale is alpha / r)
        lora_alpha=alpha,  # type: ignore[arg-type, unused-ignore]
        target_modules=list(paths),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        inference_mode=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        lora.save_pretrained(tmp)  # peft's own serialisation (enums, sets, version field)
        return json.loads((Path(tmp) / ADAPTER_CONFIG).read_text(encoding="utf-8"))

