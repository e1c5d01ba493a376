"""The GGUF file llama.cpp draws the chat's tokens from: the model's own, or a Q8_0 copy of it.

llama.cpp's CPU kernels decode a batch of sequences faster than one at a time only for some weight
types: its batched matrix products (repacked and tiled) cover Q4_0 and Q8_0, while Q4_1, Q5_0 and
Q5_1 (the default model's file is Q4_1) are multiplied one token at a time, so a batch of 16 answers
costs what 16 answers one after another do (bench/RESULTS.md, "llama.cpp's own log-probs, and a Q8_0
copy it batches"). For those types the engine serves a Q8_0 copy: each block of 32 weights dequantised
and requantised at 8 bits with its own scale, which keeps the 4- or 5-bit values to within half an
8-bit step (the weights the torch model trains on are those same dequantised values). Q4_0 would batch
faster still, but requantising to 4 bits rounds the weights a second time.

The copy is made once, by llama.cpp's own quantiser, in the model cache (shared/gguf_copy.py: named
for the file's path, size and modification time, written to a temporary folder and renamed into
place); with the cache off, or where it cannot be written, the file itself is served, and the log
says why. A file in a type llama.cpp batches is served as it is, and a note beside where its copy would
be (``<name>.as-is``) spares the next start reading its types again.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from . import gguf_copy

log = logging.getLogger(__name__)

SERVED = "model.gguf"  # the copy's file in its folder
AS_IS = ".as-is"  # beside where a copy would be: the file is in a type llama.cpp batches, served itself
# Weight types llama.cpp's CPU backend multiplies one token at a time even in a batch.
UNBATCHED = frozenset({"Q4_1", "Q5_0", "Q5_1"})


def weight_type(path: Path) -> str:
    """The type most of the file's matrices are stored in (``Q4_1``, ``Q8_0``, ``F16``, ...)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    kinds = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2)
    return kinds.most_common(1)[0][0] if kinds else "F32"


def served_file(path: Path) -> Path:
    """``path``, or its cached Q8_0 copy where its weights are in a type llama.cpp does not batch."""
    path = Path(path)
    root = gguf_copy.cache_root()
    dest = gguf_copy.copy_folder(path.resolve(), path.stem, root / "llamacpp") if root is not None else None
    # Reading the weight types parses the file's metadata: seconds on a CPU, at every start of a chat or a
    # bot. What was found is kept: the copy made before, or a note that the file is served as it is.
    if dest is not None and (dest / SERVED).is_file():
        return dest / SERVED
    as_is = dest.with_name(dest.name + AS_IS) if dest is not None else None
    if as_is is not None and as_is.is_file():
        return path
    kind = weight_type(path)
    if kind not in UNBATCHED:
        if as_is is not None:
            _note(as_is, kind)
        return path
    if dest is None:
        log.info("llama.cpp serves %s as it is (%s; the model cache is off)", path.name, kind)
        return path
    try:
        gguf_copy.write_copy(dest, lambda tmp: _requantize(path, tmp / SERVED), source=path.resolve(),
                             finished=lambda d: (d / SERVED).is_file())
    except Exception as exc:  # a full or read-only disk: the file itself still answers
        log.warning("llama.cpp serves %s as it is: its Q8_0 copy could not be written (%s: %s)", path.name,
                    type(exc).__name__, exc)
        return path
    log.info("llama.cpp serves a Q8_0 copy of %s (%s, which it does not batch): %s", path.name, kind, dest)
    return dest / SERVED


def _note(marker: Path, kind: str) -> None:
    """Remember that the file ``marker`` is named for is served as it is; a cache that cannot be written
    only means its types are read again at the next start."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{kind}\n")
    except OSError as exc:
        log.debug("could not note %s (%s); its weight types are read at each start", marker, exc)


def _requantize(source: Path, out: Path) -> None:
    import llama_cpp as L
    from llama_cpp import _logger

    _logger.set_verbose(False)  # the quantiser's per-tensor chatter goes to stderr otherwise
    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = 1
    if L.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0 or not out.is_file():
        raise RuntimeError(f"llama.cpp could not requantise {source}")
