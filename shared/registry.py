"""The adapter store: ``adapters/<model-slug>/vNNNN/`` plus a ``CURRENT`` pointer. This module is the
only one that knows the folder's format; every other one asks it.

Each version folder is a plain peft adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
loadable by ``PeftModel.from_pretrained``) with our ``meta.json`` beside it, never inside the config.
A version is written in a hidden staging folder and renamed into place, and ``CURRENT`` is replaced
atomically, so a crash never leaves a half-written adapter active.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from . import scopes
from .errors import NotFound

ADAPTER_CONFIG = "adapter_config.json"  # peft's, as peft writes it
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LEGACY_WEIGHTS = "adapter_model.bin"  # what older peft wrote: loaded and exported, never written here
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)  # what a complete version holds
WEIGHT_FILES = (ADAPTER_WEIGHTS, LEGACY_WEIGHTS)  # where a loader finds the weights, in this order
META_FILE = "meta.json"  # ours: parent, ratings, metrics, configuration
EXPORTED_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, LEGACY_WEIGHTS, META_FILE)  # a version's folder as exported
CURRENT_FILE = "CURRENT"  # the name of the version being served; absent: the base model

_VERSION = re.compile(r"^v(\d{4,})$")  # the names this registry gives its versions
_TYPED_VERSION = re.compile(r"^[vV]?0*(\d{1,9})$")  # how people name one: v0003, v3, 3
# What CURRENT may name: a plain folder name, no separators, no dots (peft adapter names become torch
# ModuleDict keys, which must not contain '.'). Loaders serve any such folder; the registry writes vNNNN.
_POINTER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_MAX_POINTER_BYTES = 256


@dataclass(frozen=True)
class Pointer:
    """What a ``CURRENT`` file says: the version it names (None: the base model), or why it names none
    though it holds something (``problem``, one line for a warning)."""

    name: str | None
    problem: str | None = None


def weights_identity(folder: Path) -> tuple[str | None, int | None, int | None]:
    """``(file, mtime_ns, size)`` of the weights a loader would read in a version's ``folder``: changes
    whenever they are rewritten; all None when it holds none."""
    for name in WEIGHT_FILES:
        try:
            st = (folder / name).stat()
        except OSError:
            continue
        return (name, st.st_mtime_ns, st.st_size)
    return (None, None, None)


def read_pointer(folder: Path) -> Pointer:
    """Read ``folder``'s ``CURRENT``. Whether the named folder exists is the caller's question."""
    path = Path(folder) / CURRENT_FILE
    try:
        with path.open("rb") as fh:
            raw = fh.read(_MAX_POINTER_BYTES + 1)
    except FileNotFoundError:
        return Pointer(None)
    except OSError as exc:
        return Pointer(None, f"cannot read {path}: {exc}")
    if len(raw) > _MAX_POINTER_BYTES:
        return Pointer(None, f"{path} is not a version name (too long)")
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return Pointer(None, f"{path} is not a version name (not text)")
    if not name:
        return Pointer(None)
    if not _POINTER.match(name):
        return Pointer(None, f"{path} holds {name[:40]!r}, not a version name")
    return Pointer(name)


def is_adapter(folder: Path) -> bool:
    """Whether ``folder`` holds a complete adapter (a version, or one staged to become one)."""
    return all((folder / f).is_file() for f in ADAPTER_FILES)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def version_name(typed: str) -> str:
    """A version as people type it (``v0003``, ``v3``, ``3``) as the registry names it (``v0003``);
    anything else as it was typed, for the registry to refuse by name."""
    found = _TYPED_VERSION.match(typed.strip())
    return f"v{int(found.group(1)):04d}" if found else typed


class AdapterRegistry:
    def __init__(self, root: Path, slug: str) -> None:
        """``slug``: a model's slug (its shared adapters) or a scope's lineage (shared/scopes.py)."""
        self.slug = slug
        self.dir = Path(root) / scopes.folder(slug)

    @property
    def current_file(self) -> Path:
        return self.dir / CURRENT_FILE

    def versions(self) -> list[str]:
        if not self.dir.is_dir():
            return []
        found = [p.name for p in self.dir.iterdir() if p.is_dir() and _VERSION.match(p.name)]
        return sorted(found, key=lambda v: int(v[1:]))

    def next_version(self) -> str:
        taken = [int(v[1:]) for v in self.versions()]
        return f"v{(max(taken) + 1 if taken else 1):04d}"

    def path(self, version: str) -> Path:
        if not version.strip():
            raise NotFound("which version? give one (v0003, v3 or 3; `rlfleet history` lists them)")
        if not _VERSION.match(version):
            raise NotFound(f"{version!r} is not a version name (expected v0001, v0002, … or 1, 2, …)")
        return self.dir / version

    def exists(self, version: str) -> bool:
        return is_adapter(self.path(version))

    def staging(self, version: str) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".staging-{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, staging: Path, version: str, meta: dict) -> Path:
        """Write meta.json and move the staged adapter into place (atomic on one filesystem)."""
        missing = [f for f in ADAPTER_FILES if not (staging / f).is_file()]
        if missing:
            raise RuntimeError(f"adapter for {version} is incomplete: missing {', '.join(missing)}")
        (staging / META_FILE).write_text(json.dumps(meta, indent=2, default=str), encoding="utf-8")
        for f in staging.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        final = self.path(version)
        os.rename(staging, final)
        _fsync_dir(self.dir)
        return final

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def meta(self, version: str) -> dict:
        p = self.path(version) / META_FILE
        try:
            return json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}

    def current(self) -> str | None:
        """The version being served: the one ``CURRENT`` names, when it is a complete version of ours."""
        name = read_pointer(self.dir).name
        return name if name is not None and _VERSION.match(name) and self.exists(name) else None

    def set_current(self, version: str | None) -> None:
        if version is None:
            self.current_file.unlink(missing_ok=True)
            return
        if not self.exists(version):
            raise NotFound(f"adapter version {version} does not exist")
        tmp = self.dir / f".{CURRENT_FILE}.{os.getpid()}"
        tmp.write_text(version + "\n", encoding="utf-8")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.current_file)
        _fsync_dir(self.dir)

    def clean_staging(self) -> int:
        """Remove staging folders left by a crashed run; returns how many."""
        if not self.dir.is_dir():
            return 0
        stale = [p for p in self.dir.iterdir() if p.name.startswith(".staging-")]
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return len(stale)
