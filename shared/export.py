"""`rlfleet export adapter|merged`: the improved model out of rlfleet, for any tool that reads peft or
transformers folders.

- adapter: the version's peft folder as is (``adapter_config.json`` + ``adapter_model.safetensors``,
  loadable by ``PeftModel.from_pretrained``), with our ``meta.json`` beside it;
- merged: the base with the adapter folded into its weights, saved as safetensors with the tokenizer,
  loadable by ``AutoModelForCausalLM.from_pretrained`` alone (a GGUF base is saved dequantised).

Both write into a staging folder next to the destination and rename it at the end, so an interrupted
export never leaves a half-written model where a complete one is expected (:func:`staged`, which
``rlfleet export ratings`` uses too); a destination that cannot be written is refused on one line first.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Literal

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


def check_target(dest: Path, kind: Literal["file", "folder"], force: bool = False) -> Path:
    """``dest`` (``~`` expanded) if an export can go there, else a one-line BadInput; nothing is written.

    A file is new, or an existing regular file with ``force``; a folder is new or empty (a folder is never
    replaced: that would delete what is in it). Missing parent folders are fine (:func:`staged` makes
    them); a path through a file is not."""
    shown = str(dest)
    dest = dest.expanduser()
    example = "ratings.jsonl" if kind == "file" else "my-export"
    if dest.name in ("", ".", ".."):
        raise BadInput(f"{shown!r} is not a {kind} name: give the path of a new {kind}, e.g. {example}")
    try:
        if dest.is_dir() and not dest.is_symlink():
            if kind == "file":
                raise BadInput(f"{shown} is a folder: give a file name to write, e.g. {shown}/{example}")
            if any(dest.iterdir()):
                raise BadInput(f"{shown} exists and is not an empty folder; pick a new one")
        elif dest.exists() or dest.is_symlink():
            if kind == "folder":
                raise BadInput(f"{shown} is a file, and this export writes a folder: give the path of a new "
                               f"or empty folder, e.g. {example}")
            if not dest.is_file():
                raise BadInput(f"{shown} exists and is not a regular file; pick a new name")
            if not force:
                raise BadInput(f"{shown} exists: pass --force to overwrite it, or pick a new name")
        for parent in dest.parents:
            if parent.exists():
                if not parent.is_dir():
                    raise BadInput(f"{parent} is a file, not a folder, so {shown} cannot be written; "
                                   "pick a path under a folder")
                break
    except OSError as exc:  # a name too long, a folder we may not list
        raise BadInput(f"cannot write {shown}: {exc.strerror or exc}") from None
    return dest


@contextmanager
def staged(dest: Path, kind: Literal["file", "folder"], force: bool = False) -> Iterator[Path]:
    """Write ``dest`` through a staging path beside it, so a failed or interrupted export never leaves a
    half-written file or folder where a complete one is expected, nor anything else behind.

    Yields the staging path (an empty folder, or a file name to create); when the block ends it takes
    ``dest``'s place. When the block fails, the staging path and any parent folder made for it are
    removed, and an OSError becomes a one-line BadInput."""
    dest = check_target(dest, kind, force)
    staging = dest.with_name(f".{dest.name}.partial")
    missing = [p for p in dest.parents if not p.exists()]  # nearest first
    try:
        for folder in reversed(missing):
            folder.mkdir()
        _remove(staging)  # left by an export that was killed
        if kind == "folder":
            staging.mkdir()
        yield staging
        if kind == "folder" and dest.is_dir():
            dest.rmdir()  # empty, checked above
        staging.replace(dest)
    except BaseException as exc:
        _remove(staging)
        for folder in missing:
            with suppress(OSError):
                folder.rmdir()
        if isinstance(exc, OSError):
            raise BadInput(f"cannot write {dest} ({exc.strerror or exc}): pick a place you can write to") from None
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(OSError):
            path.unlink()


def export_adapter(cfg: Config, dest: Path, version: str | None = None) -> tuple[Path, str]:
    _, registry, version = pick_version(cfg, version)
    src = registry.path(version)
    with staged(dest, "folder") as staging:
        for name in EXPORTED_FILES:
            if (src / name).exists():
                shutil.copy2(src / name, staging / name)
    return dest.expanduser(), version


def export_merged(cfg: Config, dest: Path, version: str | None = None) -> tuple[Path, str]:
    ref, registry, version = pick_version(cfg, version)
    with staged(dest, "folder") as staging:  # a bad destination is refused before seconds of loading
        import torch
        from peft import PeftModel

        base = load_model(ref, dtype=torch.float32)
        with quiet_peft():
            merged = PeftModel.from_pretrained(base, str(registry.path(version))).merge_and_unload()
        merged.save_pretrained(staging, safe_serialization=True)
        load_tokenizer(ref).save_pretrained(staging)
    return dest.expanduser(), version
