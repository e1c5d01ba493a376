"""A GGUF model's dequantised copy: made once, loaded from then on.

transformers reads a GGUF file by parsing every metadata field in Python and dequantising every
tensor, on each load (10–20 seconds for the default model on a CPU, with the metadata parsed once per
load: :func:`rlfleet.shared.models.gguf_parsed_once`), paid again by every process that answers or
trains (the chat, each bot, the worker's first run, an environment agent). The first
load writes what it produced, the fp32 weights as safetensors and the tokenizer, into a cache folder
(``$RLFLEET_MODEL_CACHE``, else ``$XDG_CACHE_HOME/rlfleet/hf``, else ``~/.cache/rlfleet/hf``), and
later loads read that folder in well under a second. The weights are the very tensors the GGUF
dequantises to, so answers and training are the same either way.

The folder is named for the GGUF file's path, size and modification time (a changed file gets a new
copy, and the copies of its earlier contents are removed once the new one is in place: each holds
the file's path in ``SOURCE``), written to a temporary folder and renamed into place (a crash or a
second process converting at the same time never leaves half a model). ``RLFLEET_MODEL_CACHE=off``
turns the copy off; a copy that cannot be written (a full or read-only disk) or read is skipped with
a warning, and the GGUF is loaded as before. The MLX backend reads the same folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "RLFLEET_MODEL_CACHE"
SOURCE = "rlfleet-source.txt"  # in a copy: the path of the GGUF file it was made from
OFF = {"off", "0", "false", "no"}


def cache_root() -> Path | None:
    """Where copies are kept; None when ``RLFLEET_MODEL_CACHE`` turns them off."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in OFF:
        return None
    return Path(chosen).expanduser() if chosen else default_root()


def default_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rlfleet" / "hf"


def is_model_folder(folder: Path) -> bool:
    """A Hugging Face folder with safetensors weights (what a finished copy holds)."""
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def copy_folder(source: Path, slug: str, root: Path) -> Path:
    """Where the copy of the GGUF file ``source`` lives under ``root``: named for the file's path,
    size and modification time."""
    key = str(source)
    if source.is_file():
        st = source.stat()
        key += f":{st.st_size}:{st.st_mtime_ns}"
    return root / f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def write_copy(dest: Path, write: Callable[[Path], None], source: Path | None = None,
               finished: Callable[[Path], bool] = is_model_folder) -> Path:
    """Have ``write`` fill a temporary folder beside ``dest`` and rename it into place; ``dest``. A
    copy another process finished first (``finished``) is kept (and this one dropped). Given the GGUF
    file's path (``source``), the copies of its earlier contents are removed after."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        if source is not None:
            (tmp / SOURCE).write_text(str(source))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not finished(dest):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if source is not None:
        for stale in stale_copies(dest, source):
            log.info("removing %s, the copy of an earlier %s", stale, source)
            shutil.rmtree(stale, ignore_errors=True)
    return dest


def stale_copies(dest: Path, source: Path) -> list[Path]:
    """The other finished copies beside ``dest`` made from the same GGUF path: of contents it no longer
    has (a process still reading one keeps its open files; the next load uses ``dest``)."""
    out = []
    for folder in dest.parent.iterdir():
        if folder == dest or folder.name.startswith(".") or not folder.is_dir():
            continue
        try:
            made_from = (folder / SOURCE).read_text()
        except OSError:
            continue
        if made_from == str(source):
            out.append(folder)
    return out


def drop(folder: Path, why: BaseException) -> None:
    """A copy that does not load: removed (the next load writes it again), and said once in the log."""
    log.warning("the model copy %s did not load (%s: %s); loading the GGUF file instead", folder,
                type(why).__name__, str(why).splitlines()[0] if str(why) else "")
    shutil.rmtree(folder, ignore_errors=True)
