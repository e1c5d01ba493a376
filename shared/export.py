"""`rlfleet export adapter|merged`: the improved model out of rlfleet, for any tool that reads peft or
transformers folders.

- adapter: the version's peft folder as is (``adapter_config.json`` + ``adapter_model.safetensors``,
  loadable by ``PeftModel.from_pretrained``), with our ``meta.json`` beside it;
- merged: the base with the adapter folded into its weights, saved as safetensors with the tokenizer,
  loadable by ``AutoModelForCausalLM.from_pretrained`` alone (a GGUF base is saved dequantised).

Both write into a staging folder next to the destination and rename it at the end, so an interrupted
export never leaves a half-written model where a complete one is expected.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .config import Config
from .errors import BadInput, NotFound
from .models import ModelRef, load_model, load_tokenizer, quiet_peft, resolve_model
from .registry import EXPORTED_FILES, AdapterRegistry, version_name


def pick_version(cfg: Config, version: str | None) -> tuple[ModelRef, AdapterRegistry, str]:
    """The model, its registry and the version to export (default: the one being served)."""
    ref = resolve_model(cfg.model)
    registry = AdapterRegistry(cfg.adapters_root, ref.slug)
    version = version_name(version) if version else registry.current()
    if version is None:
        raise NotFound("no adapter is being served (the base model is): name one with --version, or train first")
    if not registry.exists(version):
        known = ", ".join(registry.versions()) or "none yet"
        raise NotFound(f"no adapter version {version} (versions: {known})")
    return ref, registry, version


def _staging(dest: Path) -> Path:
    dest = dest.expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise BadInput(f"{dest} exists and is not an empty folder; pick a new one")
    staging = dest.with_name(f".{dest.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _finish(staging: Path, dest: Path) -> Path:
    dest = dest.expanduser()
    if dest.exists():
        dest.rmdir()  # empty, checked in _staging
    staging.rename(dest)
    return dest


def export_adapter(cfg: Config, dest: Path, version: str | None = None) -> tuple[Path, str]:
    _, registry, version = pick_version(cfg, version)
    staging = _staging(dest)
    src = registry.path(version)
    for name in EXPORTED_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, staging / name)
    return _finish(staging, dest), version


def export_merged(cfg: Config, dest: Path, version: str | None = None) -> tuple[Path, str]:
    import torch
    from peft import PeftModel

    ref, registry, version = pick_version(cfg, version)
    staging = _staging(dest)
    try:
        base = load_model(ref, dtype=torch.float32)
        with quiet_peft():
            merged = PeftModel.from_pretrained(base, str(registry.path(version))).merge_and_unload()
        merged.save_pretrained(staging, safe_serialization=True)
        load_tokenizer(ref).save_pretrained(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return _finish(staging, dest), version
