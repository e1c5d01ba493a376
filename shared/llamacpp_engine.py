"""Token generation on llama.cpp's kernels, for a responder whose model is a GGUF file.

A CPU decodes a token of the default model about four times faster in llama.cpp, computing on the
file's quantised weights, than in eager torch on their fp32 dequantisation (bench/RESULTS.md,
``bench.serve`` and ``bench.decode_cost``): a token's cost is reading the weights. This module only
draws tokens. The responder still computes every answer's behaviour log-probs with its torch model
(fp32, the served adapter on), the very quantity the trainer computes, so training sees what it
always did; what changes is which numerics drew the sample (the same weights, llama.cpp's quantised
products), a difference ``tests/test_llamacpp_engine.py`` bounds.

Requests that arrive together are decoded together: each conversation is a llama.cpp sequence in one
context, and every step decodes the next token of all of them in one batch, so the weights are read
once per step for the whole batch. What the batch's prompts share is decoded once: the prefix all of
them begin with (the system prompt) and each prompt asked more than once (a run's several answers to
a prompt, the gate's samples cycling its held-out prompts); the other sequences get those keys and
values by ``llama_memory_seq_cp``, cells shared, not computed again: a row draws what it draws with its
prompt decoded whole in its own sequence. Each sequence samples with its own chain (temperature, then top-p,
then a draw seeded per sequence), the order transformers applies them in. Adapters (PEFT LoRA
folders) are converted to llama.cpp's LoRA GGUF (:mod:`.lora_gguf`) into a private temporary folder
the first time they answer and kept loaded, the least recently used let go beyond ``max_adapters``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import shutil
import subprocess
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import serving_gguf
from .errors import ConfigError
from .lora_gguf import BaseShape, write_lora_gguf
from .registry import weights_identity

if TYPE_CHECKING:
    from .models import ModelRef

log = logging.getLogger(__name__)

ENGINES = ("auto", "torch", "llama.cpp")
INSTALL_HINT = "pip install llama-cpp-python (or the rlfleet[fast] extra)"
_RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's "draw a random seed"


def engine_for(ref: ModelRef, choice: str, device: str, max_adapters: int,
               max_batch: int = 16) -> LlamaCppEngine | None:
    """The llama.cpp engine for ``ref`` when ``choice`` (``chat.engine``) asks for it and it can run;
    None: torch draws the tokens. ``auto`` takes llama.cpp where the model is a GGUF file, the device a
    CPU and llama-cpp-python installed, and says why not otherwise; ``llama.cpp`` insists (an error).
    ``max_batch``: the most prompts one call of its ``generate`` takes."""
    if choice not in ENGINES:
        raise ConfigError(f"unknown engine {choice!r}: one of {', '.join(ENGINES)}")
    if choice == "torch":
        return None
    problem = None
    if ref.gguf_file is None:
        problem = f"{ref.spec} is not a GGUF file"
    elif device != "cpu":
        problem = f"it runs on {device}, where torch's kernels are the fast ones"
    elif not available():
        problem = f"llama-cpp-python is not installed ({INSTALL_HINT})"
    if problem is None:
        import torch

        try:
            served = serving_gguf.served_file(Path(ref.path) / str(ref.gguf_file))
            return LlamaCppEngine(served, threads=torch.get_num_threads(), max_batch=max_batch,
                                  max_adapters=max_adapters)
        except Exception as exc:
            problem = f"llama.cpp could not load it ({type(exc).__name__}: {exc})"
    if choice == "llama.cpp":
        raise ConfigError(f"chat.engine is llama.cpp, but {problem}")
    log.info("tokens drawn by torch: %s", problem)
    return None


class EngineCannot(RuntimeError):
    """This request cannot be generated here (too long for the context, an adapter llama.cpp cannot
    take): the responder generates it with torch instead."""


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


_PROBE = """
import sys
from pathlib import Path
from rlfleet.shared.llamacpp_engine import LlamaCppEngine
engine = LlamaCppEngine(Path(sys.argv[1]), threads=1, max_batch=1, n_ctx=512, extra_bufts=sys.argv[2] == "1")
engine.generate([[1, 2, 3]], 2, 0.0, 1.0, [])
engine.close()
"""


def decodes(gguf_path: Path, extra_bufts: bool, timeout: float = 300) -> bool:
    """Whether llama.cpp loads ``gguf_path`` and decodes with it on this CPU, tried in a child process:
    a build can hold instructions the CPU advertises but refuses (AMX tiles under some hypervisors),
    and the SIGILL that follows kills a process where no ``try`` can catch it."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(gguf_path), "1" if extra_bufts else "0"],
                              capture_output=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@functools.cache
def _repacking(gguf_path: str) -> bool:
    """Whether llama.cpp may repack ``gguf_path``'s weights on this CPU (tried once per process)."""
    if decodes(Path(gguf_path), True):
        return True
    if not decodes(Path(gguf_path), False):
        raise RuntimeError(f"llama.cpp dies decoding {gguf_path} on this CPU (with and without its repacked "
                           "weights); rebuild llama-cpp-python for this machine")
    log.info("llama.cpp decodes without its repacked weights: this CPU refuses them")
    return False


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LlamaCppEngine:
    """One llama.cpp model and context over ``gguf_path``; not thread-safe (the responder's lock
    serialises its calls)."""

    def __init__(self, gguf_path: Path, threads: int, max_batch: int = 16, n_ctx: int = 8192,
                 max_adapters: int = 8, extra_bufts: bool | None = None) -> None:
        """``extra_bufts``: let llama.cpp repack weights for this CPU's special units (AMX, ...); None:
        where a child process decodes with them (:func:`decodes`), else without, else an error."""
        import llama_cpp as L
        from llama_cpp import _logger

        _logger.set_verbose(False)  # llama.cpp's load chatter goes to stderr otherwise
        self._L = L
        self.gguf_path = Path(gguf_path)
        self.max_batch = max_batch
        self.max_adapters = max_adapters
        self.extra_bufts = _repacking(str(self.gguf_path)) if extra_bufts is None else extra_bufts
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = self.extra_bufts
        self._model = L.llama_model_load_from_file(str(self.gguf_path).encode(), mp)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {self.gguf_path}")
        self.n_ctx = min(n_ctx, max(int(L.llama_model_n_ctx_train(self._model)), 512))
        cp = L.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = min(2048, self.n_ctx)
        cp.n_ubatch = 512
        cp.n_seq_max = max_batch
        cp.kv_unified = True  # the batch's sequences share n_ctx however long each is
        cp.n_threads = cp.n_threads_batch = max(1, threads)
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not make a context for {self.gguf_path}")
        self._n_batch = int(cp.n_batch)
        self.n_vocab = int(L.llama_vocab_n_tokens(L.llama_model_get_vocab(self._model)))
        self._batch = L.llama_batch_init(self._n_batch, 0, 1)
        self._shape: BaseShape | None = None  # read when the first adapter is converted
        self._tmp = Path(tempfile.mkdtemp(prefix="rlfleet-lora-gguf-"))
        self._adapters: OrderedDict[tuple, Any] = OrderedDict()  # weights' identity -> llama adapter
        self._failed: dict[tuple, str] = {}
        self._made = 0  # converted files so far: names them
        self._set: tuple | None = ()  # the adapter key set on the context (None: unknown)
        self._cached: list[int] = []  # the tokens whose keys and values sequence 0 holds, alone in memory
        self.reused = 0  # prompt tokens whose keys and values were kept from the call before, over all calls
        self.shared = 0  # prompt tokens a batch decoded once for several of its rows, over all calls
        # Copying a prefix's keys and values between sequences needs a memory of cells per position.
        self._copies = not (L.llama_model_is_recurrent(self._model) or L.llama_model_is_hybrid(self._model))

    # ------------------------------------------------------------------ adapters

    def _meta(self, key: str) -> str | None:
        """The loaded model's GGUF metadata value under ``key``, as text (None: no such key)."""
        buf = ctypes.create_string_buffer(256)
        n = self._L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def _adapter(self, folder: Path) -> Any:
        key = (str(folder), *weights_identity(folder))
        if key in self._failed:
            raise EngineCannot(self._failed[key])
        found = self._adapters.get(key)
        if found is not None:
            self._adapters.move_to_end(key)
            return key, found
        try:
            if self._shape is None:  # from the loaded model's metadata: parsing the file again takes seconds
                self._shape = BaseShape.read(self._meta, str(self.gguf_path))
            self._made += 1
            path = write_lora_gguf(folder, self.gguf_path, self._tmp / f"{self._made}.gguf", self._shape)
            adapter = self._L.llama_adapter_lora_init(self._model, str(path).encode())
            path.unlink(missing_ok=True)  # llama.cpp holds the weights now
            if not adapter:
                raise EngineCannot(f"llama.cpp refused the converted adapter of {folder}")
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self._failed[key] = reason
            raise EngineCannot(reason) from exc
        while len(self._adapters) >= self.max_adapters:
            old_key, old = self._adapters.popitem(last=False)
            if self._set == (old_key,):
                self._L.llama_set_adapters_lora(self._ctx, None, 0, None)
                self._set = ()
            self._L.llama_adapter_lora_free(old)
        self._adapters[key] = adapter
        return key, adapter

    def _use(self, folder: Path | None) -> None:
        L = self._L
        if folder is None:
            if self._set != ():
                L.llama_set_adapters_lora(self._ctx, None, 0, None)
                self._set = ()
            return
        key, adapter = self._adapter(folder)
        if self._set != (key,):
            arr = (L.llama_adapter_lora_p_ctypes * 1)(adapter)
            scales = (ctypes.c_float * 1)(1.0)
            if L.llama_set_adapters_lora(self._ctx, arr, 1, scales) != 0:
                self._set = None
                raise EngineCannot(f"llama.cpp could not set the adapter of {folder}")
            self._set = (key,)

    # ------------------------------------------------------------------ generation

    def _sampler(self, temperature: float, top_p: float, seed: int | None) -> Any:
        L = self._L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if temperature <= 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(float(temperature)))
        if top_p < 1:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(float(top_p), 1))
        if seed is None:  # llama.cpp draws one: answers vary, as they do without a seed anywhere else
            s = _RANDOM_SEED
        else:  # a seed that happens to be the sentinel stays a seed: the same answer again
            s = int(seed) & 0xFFFFFFFF
            s = s - 1 if s == _RANDOM_SEED else s
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(s))
        return chain

    def _decode_shared(self, prompts: Sequence[list[int]], drawn: Callable[[int, int], None]) -> None:
        """Every row's prompt into its sequence (row ``i`` is sequence ``i``) and the first draw of each,
        with what rows share decoded once: the prefix every prompt begins with (a system prompt) runs in
        the first row's sequence and the same prompt asked again (a run's several answers to one prompt,
        the gate's samples cycling its held-out prompts) in its first row's; the others' sequences get
        those keys and values by ``llama_memory_seq_cp``, which shares the cells. Each row's last prompt
        token, whose logits its first draw reads, is decoded in one batch with the others'."""
        L = self._L
        memory = L.llama_get_memory(self._ctx)
        common = min(min(len(p) for p in prompts) - 1, *(shared_prefix(prompts[0], p) for p in prompts[1:]))
        first: dict[tuple[int, ...], int] = {}
        for row, ids in enumerate(prompts):
            first.setdefault(tuple(ids), row)
        leaders = sorted(first.values())
        self._decode_all([(t, i, 0, False) for i, t in enumerate(prompts[0][:common])])
        for row in leaders[1:]:
            L.llama_memory_seq_cp(memory, 0, row, 0, common)
        self._decode_all([(t, common + i, row, False)
                          for row in leaders for i, t in enumerate(prompts[row][common:-1])])
        for row, ids in enumerate(prompts):
            if first[tuple(ids)] != row:
                L.llama_memory_seq_cp(memory, first[tuple(ids)], row, 0, len(ids) - 1)
        decoded = common + sum(len(prompts[row]) - 1 - common for row in leaders)
        self.shared += sum(len(ids) - 1 for ids in prompts) - decoded
        for start in range(0, len(prompts), self._n_batch):
            rows = range(start, min(start + self._n_batch, len(prompts)))
            self._decode([(prompts[row][-1], len(prompts[row]) - 1, row, True) for row in rows])
            for j, row in enumerate(rows):
                drawn(row, j)

    def _decode_all(self, tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        """:meth:`_decode` in batches of at most ``n_batch`` rows, in order."""
        for start in range(0, len(tokens), self._n_batch):
            self._decode(tokens[start:start + self._n_batch])

    def _decode(self, tokens: Sequence[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` of ``(token, position, sequence, wants logits)`` rows."""
        b = self._batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(tokens)
        rc = self._L.llama_decode(self._ctx, b)
        if rc == 1:
            raise EngineCannot("llama.cpp's context is full")
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc})")

    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        end_ids: Sequence[int],
        seeds: Sequence[int | None] | None = None,
        adapter: Path | None = None,
        on_token: Callable[[int, int], None] | None = None,
        logprobs: list[list[float]] | None = None,
        stop: Callable[[int, list[int]], bool] | None = None,
    ) -> list[list[int]]:
        """The new token ids of each prompt, up to and including its end token (at most
        ``max_new_tokens``), with the adapter folder ``adapter`` applied (None: the base model).
        ``on_token(row, token)`` is called as each token is drawn. Raises :class:`EngineCannot` when
        the batch does not fit this context or the adapter cannot be applied. ``logprobs``: a list
        that gets each row's raw log p(token) under llama.cpp's own logits (temperature 1, no top-p).
        ``stop(row, new_ids)``: True ends the row at that token, as its end token would."""
        if not prompts:
            return []
        if len(prompts) > self.max_batch:
            raise EngineCannot(f"{len(prompts)} prompts at once, more than {self.max_batch}")
        if any(not p for p in prompts):
            raise ValueError("an empty prompt")
        if sum(len(p) + max_new_tokens for p in prompts) > self.n_ctx:
            raise EngineCannot(f"the batch needs more than llama.cpp's context of {self.n_ctx} tokens")
        before = self._set
        self._use(adapter)
        L, ctx = self._L, self._ctx
        # One prompt after one prompt with the same adapter: the keys and values of the prefix they share
        # (a system prompt, an earlier turn) stay; anything else starts from an empty memory.
        # At most all but the prompt's last token, whose logits the first draw needs.
        kept = shared_prefix(self._cached, prompts[0][:-1]) if len(prompts) == 1 and self._set == before else 0
        self._cached = []
        if not (kept and L.llama_memory_seq_rm(L.llama_get_memory(ctx), 0, kept, -1)):
            kept = 0  # (a model whose memory cannot be cut part-way starts over too)
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
        self.reused += kept
        ends = set(int(i) for i in end_ids)
        seeds = list(seeds) if seeds is not None else [None] * len(prompts)
        chains = [self._sampler(temperature, top_p, s) for s in seeds]
        outs: list[list[int]] = [[] for _ in prompts]
        live: list[int] = []
        if logprobs is not None:
            logprobs[:] = [[] for _ in prompts]

        def drawn(row: int, idx: int) -> None:
            if logprobs is not None:
                raw = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, idx), shape=(self.n_vocab,)).astype(np.float64)
            tok = int(L.llama_sampler_sample(chains[row], ctx, idx))
            if logprobs is not None:
                top = raw.max()
                logprobs[row].append(float(raw[tok] - top - np.log(np.exp(raw - top).sum())))
            outs[row].append(tok)
            if on_token is not None:
                on_token(row, tok)
            if tok not in ends and len(outs[row]) < max_new_tokens and not (stop is not None and stop(row, outs[row])):
                live.append(row)

        try:
            if len(prompts) > 1 and self._copies:
                self._decode_shared(prompts, drawn)
            else:
                for row, ids in enumerate(prompts):
                    for start in range(kept if row == 0 else 0, len(ids), self._n_batch):
                        chunk = ids[start:start + self._n_batch]
                        last = start + len(chunk) == len(ids)
                        self._decode([(t, start + i, row, last and i == len(chunk) - 1)
                                      for i, t in enumerate(chunk)])
                    drawn(row, len(chunk) - 1)
            while live:
                step, live[:] = list(live), []
                self._decode([(outs[r][-1], len(prompts[r]) + len(outs[r]) - 1, r, True) for r in step])
                for j, r in enumerate(step):
                    drawn(r, j)
        finally:
            for chain in chains:
                L.llama_sampler_free(chain)
        if len(prompts) == 1:
            self._cached = list(prompts[0]) + outs[0][:-1]  # every token decoded: all but the last drawn
        return outs

    def close(self) -> None:
        L = getattr(self, "_L", None)
        if L is None or not getattr(self, "_ctx", None):
            return
        L.llama_batch_free(self._batch)
        for adapter in self._adapters.values():
            L.llama_adapter_lora_free(adapter)
        self._adapters.clear()
        L.llama_free(self._ctx)
        L.llama_model_free(self._model)
        self._ctx = self._model = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __del__(self) -> None:  # a responder dropped without close() frees llama.cpp's memory too
        try:
            self.close()
        except Exception:
            pass
