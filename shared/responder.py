"""The local responder: answers chat messages with the base model plus the current LoRA adapter.

``<data>/adapters/<slug>/`` holds one folder per trained version (``v0001/``: a PEFT adapter) and a
text file ``CURRENT`` that names the active one. No ``CURRENT`` (or an unusable one) means the base
model. :meth:`LocalResponder.answer` picks up a changed ``CURRENT`` before every answer (hot swap, no
restart) and records, with every answer, the raw log-probabilities of the generated tokens: the
behaviour policy is the model itself at temperature 1 without top-p, computed by one fp32 forward pass
over the answer on the prompt's keys and values, i.e. the same quantity the trainer computes
(docs/objective.md). A request may name a scope (shared/scopes.py): that scope's own ``CURRENT``
answers it, its adapter loaded beside the shared one (docs/scopes.md). With ``engine`` llama.cpp (a
GGUF model and llama-cpp-python installed: :mod:`.llamacpp_engine`), llama.cpp draws the tokens and
the torch model still computes their log-probs.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import llamacpp_engine, scopes
from .chat_prompt import prompt_ids, without_earliest_turn
from .config import Config
from .errors import ContextTooLong
from .events import FinishReason
from .models import (
    ModelRef,
    cache_argument,
    end_token_ids,
    load_model,
    load_tokenizer,
    quiet_peft,
    tuner_layers,
)
from .registry import ADAPTER_CONFIG, CURRENT_FILE, WEIGHT_FILES, read_pointer, weights_identity
from .stop_strings import StopCheck, cut_answer

log = logging.getLogger(__name__)

_NEVER = object()  # matches no state key (None is a real one: the base model)


@dataclass(frozen=True)
class Answer:
    text: str  # decoded without special tokens, stripped
    token_ids: list[int]  # generated ids, including the end token when one was generated
    # raw log p(token) under the answering policy (temperature 1, no top-p): torch's fp32 pass, or where
    # llama.cpp drew the answer (chat.engine) the logits it drew from (docs/objective.md, "Behaviour")
    logprobs: list[float]
    adapter_version: str | None  # None = the base model
    model: str  # the model spec
    seconds: float
    new_tokens: int
    prompt_tokens: int  # the prompt as the model read it (system prompt and chat template included)
    # The conversation the prompt was built from, system prompt included: store this as the capture's
    # prompt, so the trainer rebuilds the very prompt these log-probs were computed under.
    messages: list[dict] = field(default_factory=list)
    finish_reason: FinishReason = "stop"  # "length": the cap cut it off before an end token


@dataclass(frozen=True)
class _Batch:
    """One batched ``generate``: the conversations as built (system prompt included), their prompt ids,
    and each row's new ids up to and including its end token."""

    built: list[list[dict]]
    rows: list[list[int]]
    news: list[Any]
    pad_id: int
    logprobs: list[list[float]] | None = None  # llama.cpp's, where it drew the rows; None: torch's pass


@dataclass(frozen=True)
class _Selected:
    """The module that answers a request, the adapter version it answers with (None: the base), the
    context to generate in, what identifies that state (for a :class:`TurnCache`), and the version's
    adapter folder (None: the base)."""

    model: Any
    version: str | None
    context: AbstractContextManager
    key: tuple
    folder: Path | None = None


@dataclass(frozen=True)
class Sample:
    """One answer of a batch sampled to measure the model (held-out prompts): nothing is captured from
    it, so it carries no log-probs."""

    text: str  # decoded without special tokens, stripped
    token_ids: list[int]  # generated ids, including the end token when one was generated
    adapter_version: str | None
    messages: list[dict] = field(default_factory=list)  # the conversation, system prompt included


@dataclass
class TurnCache:
    """One conversation's attention keys and values, kept between its turns so that a turn encodes only
    the tokens its prompt adds (an environment agent's episode re-sends every earlier turn). Valid for
    the model state it was made under: a version switch starts it over. ``reused`` and ``encoded``
    count prompt tokens taken from the cache and run through the model, over all turns."""

    key: Any = _NEVER
    ids: list[int] = field(default_factory=list)  # the tokens whose keys and values ``past`` holds
    past: Any = None
    reused: int = 0
    encoded: int = 0

    def keep(self, prompt: list[int], key: Any) -> int:
        """How many leading tokens of ``prompt`` the cache holds under ``key`` (at most all but the last
        one: a step must run at least one token), the rest of it dropped; 0 when it is of another state."""
        if key != self.key or self.past is None:
            self.past, self.ids, self.key = None, [], key
            return 0
        n = llamacpp_engine.shared_prefix(self.ids, prompt[:-1])
        _drop_after(self.past, n)
        self.ids = self.ids[:n]
        return n


def _drop_after(past: Any, n: int) -> None:
    """Keep the first ``n`` tokens of a transformers cache (``crop`` takes a negative count to remove
    in every release that has it; a non-negative one meant different things across releases)."""
    extra = int(past.get_seq_length()) - n
    if extra > 0:
        past.crop(-extra)


def sampling(temperature: float, top_p: float) -> dict[str, Any]:
    """The ``generate()`` settings of an answer drawn at ``temperature`` and ``top_p`` (temperature 0:
    the likeliest tokens): how the chat answers, and how the gate samples what it will serve.

    Exactly temperature/top-p: no top-k or penalties from the model's defaults (the recorded
    log-probs are raw either way, but answers should follow the settings). Explicit no-op values,
    not None: generate() fills None fields from model.generation_config."""
    if temperature > 0:
        return {"top_k": 0, "repetition_penalty": 1.0, "do_sample": True, "temperature": float(temperature),
                "top_p": float(top_p)}
    # Greedy ignores top-k, and generate() warns on the user's screen when one is passed with it.
    return {"repetition_penalty": 1.0, "do_sample": False, "temperature": 1.0, "top_p": 1.0}


class LocalResponder:
    """Base model + hot-swapped LoRA adapter, in process (transformers + peft). Thread-safe."""

    def __init__(
        self,
        ref: ModelRef,
        adapters_dir: Path,
        device: str = "cpu",
        max_new_tokens: int = 200,
        temperature: float = 0.7,
        top_p: float = 0.9,
        system_prompt: str | None = None,
        max_adapters: int = 8,
        scope_fallback: bool = False,
        engine: str = "torch",
    ) -> None:
        if max_adapters < 1:
            raise ValueError("max_adapters must be at least 1")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("temperature must be >= 0 and top_p in (0, 1]")
        self.ref = ref
        self.adapters_dir = Path(adapters_dir)
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.system_prompt = system_prompt

        self._lock = threading.RLock()
        self.tokenizer = load_tokenizer(ref)
        self._base = load_model(ref, device=device)
        self._peft: Any = None  # PeftModel wrapping self._base while an adapter is loaded
        self._active: str | None = None  # adapter version in use; None = base
        self._key: tuple | None = None  # identity of what is loaded (version, weights stat)
        self._failed_key: object = _NEVER  # a state that failed to load: not retried until it changes
        self._warned: str | None = None  # last warning about CURRENT, so it is logged once, not per answer
        self._pin: tuple[str | None] | None = None  # (version,) while pinned(): answers ignore CURRENT
        # Scopes' adapters loaded beside CURRENT's (shared/scopes.py), least recently used first: their
        # weights' identity -> the name peft holds them under; at most max_adapters of them.
        self.max_adapters = max_adapters
        self.scope_fallback = scope_fallback  # a scope with no version of its own: the shared one answers
        self._scoped: OrderedDict[tuple, str] = OrderedDict()
        self._scoped_failed: set[tuple] = set()
        self._tuner_layers: list | None = None  # the model's LoRA layers, found once per set of adapters
        self._eos_ids = self._end_token_ids()
        self._cache_arg = cache_argument(self._base)
        self._engine = llamacpp_engine.engine_for(ref, engine, device, max_adapters)
        self._engine_said: set[str] = set()  # why llama.cpp could not answer, each said once
        self.refresh()

    @property
    def engine(self) -> str:
        """What draws the answers' tokens (and gives their log-probs): ``llama.cpp`` or ``torch``."""
        return "llama.cpp" if self._engine is not None else "torch"

    # ------------------------------------------------------------------ adapter selection

    @property
    def active_version(self) -> str | None:
        """The adapter version answers come from now (None = base); changes only in refresh()."""
        return self._active

    @property
    def model(self) -> Any:
        """The module that generates: the PeftModel while an adapter is active, else the base."""
        return self._peft if self._peft is not None else self._base

    def current_version(self) -> str | None:
        """The version that ``CURRENT`` names, or None: file missing, empty, unreadable, not a
        plain name, or naming a folder that does not exist (the last two are logged as warnings)."""
        pointer = read_pointer(self.adapters_dir)
        if pointer.problem is not None:
            self._warn(f"{pointer.problem}; answering with the base model")
            return None
        name = pointer.name
        if name is None:
            self._warned = None
            return None
        if not (self.adapters_dir / name).is_dir():
            self._warn(f"{self.adapters_dir / CURRENT_FILE} names {name}, but {self.adapters_dir / name} does not "
                       "exist; answering with the base model")
            return None
        self._warned = None
        return name

    def _warn(self, message: str) -> None:
        if message != self._warned:  # once per problem, not once per answer
            log.warning(message)
            self._warned = message

    def refresh(self) -> str | None:
        """Load the adapter ``CURRENT`` names if that changed since the last load.

        Returns the version now in use when it switched to an adapter, else None (also when it
        switched back to the base: compare :attr:`active_version` before and after to see that).
        Cheap when nothing changed: reads ``CURRENT`` and stats two paths. A version that fails to
        load is logged once; the previous one keeps answering until ``CURRENT`` or its files change.
        """
        with self._lock:
            version = self._pin[0] if self._pin is not None else self.current_version()
            key = self._state_key(version)
            if key == self._key or key == self._failed_key:
                return None
            try:
                self._switch(version)
            except Exception as exc:  # a broken adapter must not take the chat down
                self._failed_key = key
                still = f"version {self._active}" if self._active else "the base model"
                log.warning("cannot load adapter %s from %s (%s: %s); still answering with %s",
                            version, self.adapters_dir, type(exc).__name__, exc, still)
                return None
            self._key, self._failed_key = key, _NEVER
            if version is None:
                log.info("answering with the base model of %s", self.ref.spec)
                return None
            log.info("answering with adapter %s of %s", version, self.ref.spec)
            return version

    @contextmanager
    def pinned(self, version: str | None) -> Iterator[None]:
        """Answer with ``version`` (None: the base) instead of the one ``CURRENT`` names inside the
        block: a candidate judged before it is served (the gym's held-out episodes). The lock is held
        throughout, so no other thread's answer sees the pin; a version that does not load raises."""
        with self._lock:
            self._pin = (version,)
            try:
                key = self._state_key(version)
                if key != self._key:
                    self._switch(version)
                    self._key, self._failed_key = key, _NEVER
                yield
            finally:
                self._pin = None

    def _state_key(self, version: str | None, adapters_dir: Path | None = None) -> tuple | None:
        if version is None:
            return None
        return (version, *weights_identity((adapters_dir or self.adapters_dir) / version))

    def _switch(self, version: str | None) -> None:
        self._tuner_layers = None  # the adapters loaded change: their layers are found again
        if version is None:
            if self._peft is not None:
                self._base = self._peft.unload()  # removes the LoRA layers in place; the base is intact
                self._peft = None
                self._scoped.clear()  # loaded again when a scope asks
            self._active = None
            return

        folder = self.adapters_dir / version
        if not (folder / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"{folder / ADAPTER_CONFIG} is missing")
        if not any((folder / name).is_file() for name in WEIGHT_FILES):
            raise FileNotFoundError(f"{folder} holds no adapter weights ({' or '.join(WEIGHT_FILES)})")

        if self._peft is not None and version in self._peft.peft_config:
            # The same name with new files (e.g. a lineage reset reused it): start over from the base.
            self._base = self._peft.unload()
            self._peft, self._active, self._key = None, None, None
            self._scoped.clear()

        old = self._active
        self._load_named(folder, version)
        with quiet_peft():
            self._peft.set_adapter(version)
            if old is not None and old != version and old in self._peft.peft_config:
                self._peft.delete_adapter(old)
        self._active = version

    def _select(self, scope: str | None) -> _Selected:
        """Inside the lock: what answers for ``scope`` (None or ``shared``: the version ``CURRENT``
        names; another key: that scope's own ``CURRENT``, its base model when it has none)."""
        self.refresh()
        version = name = folder = None
        if scope is not None and scope != scopes.SHARED:
            version, name, folder = self._scope_adapter(scope)
        if name is None and (scope is None or scope == scopes.SHARED or self.scope_fallback):
            version = name = self._active
            folder = self.adapters_dir / name if name is not None else None
        # what a TurnCache's keys were made under (a scope's slot name stays when its weights are swapped)
        key = (scope, name, version, self._key if name == self._active else None)
        if self._peft is None:
            return _Selected(self._base, None, nullcontext(), key)
        if name is None:  # the base while adapters are loaded: their layers off for the call
            return _Selected(self._peft, None, self._peft.disable_adapter(), key)
        self._activate(name)
        return _Selected(self._peft, version, nullcontext(), key, folder)

    def _activate(self, name: str) -> None:
        """Make the loaded adapter ``name`` the one that answers. peft's ``set_adapter`` also sets
        ``requires_grad`` on every adapter weight (tens of ms a switch on the default model: see
        bench.scopes); answering needs only each LoRA layer's active name."""
        if self._tuner_layers is None:
            self._tuner_layers = tuner_layers(self._peft)
        for layer in self._tuner_layers:
            layer._active_adapter = [name]
        self._peft.base_model.active_adapter = name

    def _scope_adapter(self, scope: str) -> tuple[str | None, str | None, Path | None]:
        """``(version, peft name, folder)`` of the adapter ``scope``'s ``CURRENT`` names, loaded if it
        is not (the least recently used scope's let go beyond ``max_adapters``); all None: its base
        model (no version yet, or one that does not load: said once)."""
        folder = self.adapters_dir.parent / scopes.folder(scopes.lineage(self.adapters_dir.name, scope))
        pointer = read_pointer(folder)
        version = pointer.name if pointer.problem is None else None
        if version is None or not (folder / version).is_dir():
            return None, None, None
        key = (str(folder), *(self._state_key(version, folder) or ()))
        name = self._scoped.get(key)
        if name is not None:
            self._scoped.move_to_end(key)
            return version, name, folder / version
        if key in self._scoped_failed:
            return None, None, None
        try:
            name = self._load_scope(folder / version, key)
        except Exception as exc:  # a broken adapter answers as the base model, never takes the chat down
            self._scoped_failed.add(key)
            log.warning("cannot load adapter %s of scope %s from %s (%s: %s); answering it with the base model",
                        version, scope, folder, type(exc).__name__, exc)
            return None, None, None
        self._scoped[key] = name
        return version, name, folder / version

    def _load_scope(self, folder: Path, key: tuple) -> str:
        """The adapter in ``folder`` loaded for the scope state ``key``; its peft name. At capacity, the
        least recently used scope's slot takes its weights in place (peft's hotswap: a fraction of a
        fresh load, which builds every LoRA layer again) or, when the shapes differ, is let go first."""
        while len(self._scoped) >= self.max_adapters:
            _, slot = self._scoped.popitem(last=False)
            if len(self._scoped) < self.max_adapters and slot in self._peft.peft_config:
                try:
                    from peft.utils.hotswap import hotswap_adapter

                    with quiet_peft():
                        hotswap_adapter(self._peft, str(folder), adapter_name=slot, torch_device=self.device)
                    return slot
                except Exception:  # another rank or other layers: a fresh load below
                    log.debug("hotswap into %s failed; loading %s afresh", slot, folder, exc_info=True)
            if slot in self._peft.peft_config:
                with warnings.catch_warnings():  # "was active, now deleted": the next answer activates its own
                    warnings.simplefilter("ignore", UserWarning)
                    self._peft.delete_adapter(slot)
                self._tuner_layers = None
        name = "scope-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        self._load_named(folder, name)
        return name

    def _load_named(self, folder: Path, name: str) -> None:
        """The adapter in ``folder`` into the model under ``name``, beside those loaded (the first one
        wraps the base in a PeftModel; a failed load leaves the model as it was)."""
        if not (folder / ADAPTER_CONFIG).is_file():
            raise FileNotFoundError(f"{folder / ADAPTER_CONFIG} is missing")
        from peft import PeftModel  # imported late: costs seconds, and the base model needs none

        self._tuner_layers = None  # the LoRA layers are found again after any load
        with quiet_peft():
            if self._peft is None:
                try:
                    self._peft = PeftModel.from_pretrained(self._base, str(folder), adapter_name=name,
                                                           is_trainable=False, torch_device=self.device)
                except Exception:
                    self._repair_base()
                    raise
            else:
                try:
                    self._peft.load_adapter(str(folder), adapter_name=name, is_trainable=False,
                                            torch_device=self.device)
                except Exception:
                    if name in self._peft.peft_config:
                        self._peft.delete_adapter(name)
                    raise
        self._peft.eval()

    def _repair_base(self) -> None:
        """PeftModel.from_pretrained injects LoRA layers into the base before loading weights; if
        loading then failed, those layers stay behind. Reload a clean base in that case."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(m, BaseTunerLayer) for m in self._base.modules()):
            log.warning("reloading %s after a failed adapter load", self.ref.spec)
            self._base = load_model(self.ref, device=self.device)

    # ------------------------------------------------------------------ answering

    @property
    def context_tokens(self) -> int:
        """The most tokens the model reads at once, prompt and answer together (its trained context)."""
        return int(getattr(self._base.config, "max_position_embeddings", None) or 1 << 30)

    def check_fits(self, messages: list[dict], room: int = 1) -> int:
        """The prompt's token count when ``messages`` leave the model ``room`` tokens to answer in; else
        :class:`ContextTooLong`, without drawing (a server refuses such a request before it waits)."""
        n = len(prompt_ids(self.tokenizer, self._with_system(messages)))
        self._refuse_past_context(n, room)
        return n

    def fit_history(self, messages: list[dict]) -> list[dict]:
        """A chat's ``messages`` without as many of their earliest turns as it takes to leave room for a
        whole answer (or a quarter of the context): a long conversation goes on with less of its past
        rather than being refused. :class:`ContextTooLong` when the last message alone leaves none."""
        msgs, room = list(messages), min(self.max_new_tokens, self.context_tokens // 4)
        while True:
            shorter = without_earliest_turn(msgs)
            try:
                self.check_fits(msgs, room if shorter is not None else 1)  # nothing left to drop: any room
                return msgs
            except ContextTooLong:
                if shorter is None:
                    raise
                msgs = shorter

    def _room(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """``max_new_tokens`` cut to what the context leaves after the prompt (the answer then ends
        ``length``); a prompt that leaves no room is refused."""
        self._refuse_past_context(prompt_tokens)
        return min(max_new_tokens, self.context_tokens - prompt_tokens)

    def _refuse_past_context(self, prompt_tokens: int, room: int = 1) -> None:
        if prompt_tokens + room > self.context_tokens:
            raise ContextTooLong(f"the conversation is {prompt_tokens:,} tokens and the model reads at most "
                                 f"{self.context_tokens:,} at once, its answer included: shorten it or start "
                                 "a new conversation")


    def answer(
        self,
        messages: list[dict],
        seed: int | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        on_text: Callable[[str], None] | None = None,
        cache: TurnCache | None = None,
        scope: str | None = None,
        stop: Sequence[str] | None = None,
    ) -> Answer:
        """Answer a conversation (``[{"role": ..., "content": ...}, ...]``) with the current version;
        the sampling settings default to the responder's own. ``on_text`` is called, from this thread,
        with each piece of decoded text as it is generated (whole words where the tokenizer can tell).
        ``cache``: the conversation's :class:`TurnCache` from its earlier turns; the prompt's tokens it
        holds are not encoded again, and it is left holding this turn's. The log-probs come from one
        pass over the answer's tokens on the prompt's keys and values, not over the whole conversation.
        Where llama.cpp draws (``chat.engine``), the log-probs are those of the logits it drew from, torch
        runs nothing, and llama.cpp keeps its own prefix instead of ``cache``.
        ``scope``: a scope key (shared/scopes.py) whose own adapter answers; None: ``CURRENT``'s.
        ``stop``: OpenAI's stop strings: drawing ends at the token that completes one, and the answer
        is cut where it begins (shared/stop_strings.py); ``on_text`` has had the drawn text."""
        import torch
        from transformers import DynamicCache

        with self._lock:
            t0 = time.perf_counter()
            chosen = self._select(scope)
            msgs = self._with_system(messages)
            ids = prompt_ids(self.tokenizer, msgs)
            new_cap = self._room(len(ids), self.max_new_tokens if max_new_tokens is None else max_new_tokens)
            temp = self.temperature if temperature is None else temperature
            p = self.top_p if top_p is None else top_p
            streamer = _TextPieces(self.tokenizer, on_text) if on_text is not None else None
            check = StopCheck(self.tokenizer, [stop or []])
            drawn_lps: list[list[float]] = []
            drawn = self._engine_draw(chosen, [ids], new_cap, temp, p, [seed], streamer, drawn_lps, check)
            if drawn is not None:  # llama.cpp drew it and gave its log-probs: torch has nothing to do
                got, logprobs = drawn[0], drawn_lps[0]
            else:
                cache = cache if cache is not None else TurnCache()
                model = chosen.model
                reused = cache.keep(ids, chosen.key)
                if cache.past is None:
                    cache.past = DynamicCache(config=model.config)
                cache.reused, cache.encoded = cache.reused + reused, cache.encoded + len(ids) - reused
                prompt = torch.tensor([ids], device=self.device)
                with torch.inference_mode(), seeded_rng(seed, self.device), chosen.context:
                    gc = self._generation_config(model, new_cap, temp, p)
                    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), generation_config=gc,
                                         streamer=streamer, stopping_criteria=_stopping(check, len(ids)),
                                         **{self._cache_arg: cache.past})
                    new = self._cut_at_end(out[0, len(ids):])
                    logprobs = self._cached_logprobs(model, ids, new, cache, len(ids) - 1)
                got = new.tolist()
            return cut_answer(Answer(
                text=self.tokenizer.decode(got, skip_special_tokens=True).strip(), token_ids=got, logprobs=logprobs,
                adapter_version=chosen.version, model=self.ref.spec, seconds=time.perf_counter() - t0,
                new_tokens=len(got), prompt_tokens=len(ids), messages=msgs,
                finish_reason="stop" if got and got[-1] in self._eos_ids else "length",
            ), stop or [], self.tokenizer)

    def _cached_logprobs(self, model: Any, ids: list[int], new: Any, cache: TurnCache, start: int) -> list[float]:
        """The answer's raw log-probs: the prompt from its token ``start`` on and the answer but its
        last token, run on the cache's keys and values of the prompt before ``start`` (its cache is
        cut there first); the cache then holds them for the next turn."""
        import torch

        _drop_after(cache.past, start)
        cache.ids = ids[:start]
        if not new.numel():
            return []
        step = torch.tensor([ids[start:] + new[:-1].tolist()], device=self.device)
        mask = torch.ones(1, start + step.shape[1], dtype=torch.long, device=self.device)
        logits = model(input_ids=step, attention_mask=mask, use_cache=True, logits_to_keep=int(new.numel()),
                       **{self._cache_arg: cache.past}).logits[0, -int(new.numel()):]
        cache.ids = ids + new[:-1].tolist()
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(-1, new.view(-1, 1)).squeeze(-1).tolist()

    def _engine_draw(self, chosen: _Selected, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                     top_p: float, seeds: list[int | None], streamer: _TextPieces | None = None,
                     logprobs: list[list[float]] | None = None,
                     stop: StopCheck | None = None) -> list[list[int]] | None:
        """The new ids of each prompt drawn by llama.cpp with ``chosen``'s adapter, in batches of what
        its context holds; None: torch draws them (no llama.cpp, or it cannot take this request:
        said once per reason). ``logprobs`` gets each row's raw log-probs under llama.cpp's logits;
        ``stop`` ends a row at the token that completes one of its stop strings."""
        if self._engine is None:
            return None
        if streamer is not None:
            streamer.prompt_seen = True  # llama.cpp hands over new tokens only
        on_token = (lambda _row, tok: streamer.put([tok])) if streamer is not None else None
        step = self._engine.max_batch
        try:
            out: list[list[int]] = []
            lps: list[list[float]] = []
            for i in range(0, len(prompts), step):
                part: list[list[float]] | None = [] if logprobs is not None else None
                ends = (lambda row, ids, first=i: stop(first + row, ids)) if stop else None
                out += self._engine.generate(prompts[i:i + step], max_new_tokens, temperature, top_p, self._eos_ids,
                                             seeds[i:i + step], chosen.folder, on_token, part, ends)
                lps += part or []
        except Exception as exc:  # llama.cpp failing must not take the chat down: torch answers
            reason = f"{type(exc).__name__}: {exc}"
            if reason not in self._engine_said:
                self._engine_said.add(reason)
                log.warning("llama.cpp cannot answer this (%s); torch answers it", reason)
            if streamer is not None:
                streamer.reset()
            return None
        if streamer is not None:
            streamer.end()
        if logprobs is not None:
            logprobs[:] = lps
        return out

    def answer_many(
        self,
        conversations: Sequence[list[dict]],
        seed: int | None = None,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        scope: str | None = None,
        stops: Sequence[Sequence[str]] | None = None,
    ) -> list[Answer]:
        """:meth:`answer` for many conversations at once: one batched ``generate`` and one batched
        log-prob pass (left-padded rows, positions counted from each row's first real token), so on a
        CPU, where a token's cost is mostly fixed overhead, N answers cost far less than N. Each answer
        is the one :meth:`answer` gives, with its raw log-probs; ``seed`` seeds the batch's one random
        stream, so a seeded request repeats its answer only when it is asked alone. ``scope``: as in
        :meth:`answer`, one for the whole batch; ``stops``: each conversation's stop strings, as
        :meth:`answer`'s ``stop`` (a row that completes one stops drawing while the others go on)."""
        import torch

        if not conversations:
            return []
        with self._lock:
            t0 = time.perf_counter()
            chosen = self._select(scope)
            rows_stops = [list(x) for x in stops] if stops is not None else [[] for _ in conversations]
            with chosen.context:
                batch = self._generate_batch(
                    chosen, conversations, seed, max_new_tokens,
                    self.temperature if temperature is None else temperature,
                    self.top_p if top_p is None else top_p, with_logprobs=True,
                    stop=StopCheck(self.tokenizer, rows_stops),
                )
                logprobs = batch.logprobs if batch.logprobs is not None else batch_token_logprobs(
                    chosen.model, [torch.tensor(r, device=self.device) for r in batch.rows], batch.news, batch.pad_id)
            seconds = time.perf_counter() - t0
            answers = []
            for new, lps, msgs, row, row_stops in zip(batch.news, logprobs, batch.built, batch.rows, rows_stops,
                                                      strict=True):
                got = new.tolist()
                answers.append(cut_answer(Answer(
                    text=self.tokenizer.decode(got, skip_special_tokens=True).strip(), token_ids=got,
                    logprobs=lps, adapter_version=chosen.version, model=self.ref.spec, seconds=seconds,
                    new_tokens=len(got), prompt_tokens=len(row), messages=msgs,
                    finish_reason="stop" if got and got[-1] in self._eos_ids else "length",
                ), row_stops, self.tokenizer))
            return answers

    def sample(
        self,
        conversations: Sequence[list[dict]],
        seed: int | None = None,
        max_new_tokens: int | None = None,
        scope: str | None = None,
    ) -> list[Sample]:
        """Answer many conversations in one ``generate`` call with the current version and the
        responder's sampling settings (left-padded, so every row's next token comes at the same position).
        A CPU answers a batch for the cost of a few single answers, which makes measuring on many
        held-out answers affordable; repeat a conversation to get several answers to it."""
        if not conversations:
            return []
        with self._lock:
            chosen = self._select(scope)
            with chosen.context:
                batch = self._generate_batch(chosen, conversations, seed, max_new_tokens, self.temperature,
                                             self.top_p)
            samples = []
            for new, msgs in zip(batch.news, batch.built, strict=True):
                got = new.tolist()
                samples.append(Sample(text=self.tokenizer.decode(got, skip_special_tokens=True).strip(),
                                      token_ids=got, adapter_version=chosen.version, messages=msgs))
            return samples

    def _generate_batch(self, chosen: _Selected, conversations: Sequence[list[dict]], seed: int | None,
                        max_new_tokens: int | None, temperature: float, top_p: float,
                        with_logprobs: bool = False, stop: StopCheck | None = None) -> _Batch:
        """One left-padded ``generate`` over the conversations with ``chosen`` (the caller holds the lock
        and :meth:`_select`-ed it), or llama.cpp's batch: the conversations as built, their prompt ids,
        and each row's new ids cut at its end token (``with_logprobs``: llama.cpp's batch brings its
        log-probs too)."""
        import torch

        built = [self._with_system(c) for c in conversations]
        rows = [prompt_ids(self.tokenizer, m) for m in built]
        model = chosen.model
        gc = self._generation_config(model, self._room(max(map(len, rows)), self.max_new_tokens
                                                       if max_new_tokens is None else max_new_tokens),
                                     temperature, top_p)
        seeds = [None if seed is None else seed + i for i in range(len(rows))]
        lps: list[list[float]] | None = [] if with_logprobs else None
        drawn = self._engine_draw(chosen, rows, int(gc.max_new_tokens), temperature, top_p, seeds, logprobs=lps,
                                  stop=stop)
        if drawn is not None:
            return _Batch(built, rows, [torch.tensor(d, dtype=torch.long, device=self.device) for d in drawn],
                          int(gc.pad_token_id), lps)
        ids, mask = left_padded(rows, gc.pad_token_id, self.device)
        width = ids.shape[1]
        with torch.inference_mode(), seeded_rng(seed, self.device):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc,
                                 stopping_criteria=_stopping(stop, width))
        return _Batch(built, rows, [self._cut_at_end(row) for row in out[:, width:]], int(gc.pad_token_id))

    def _with_system(self, messages: list[dict]) -> list[dict]:
        msgs = [dict(m) for m in messages]
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def _end_token_ids(self) -> list[int]:
        ids = end_token_ids(self._base, self.tokenizer)
        if not ids:
            raise ValueError(f"{self.ref.spec} defines no end token")
        return ids

    def _generation_config(self, model: Any, max_new_tokens: int, temperature: float, top_p: float) -> Any:
        gc = copy.deepcopy(model.generation_config)
        gc.max_new_tokens = max_new_tokens
        gc.eos_token_id = self._eos_ids
        if gc.pad_token_id is None:
            gc.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
                else self._eos_ids[0]
        gc.num_beams = 1
        for name, value in sampling(temperature, top_p).items():
            setattr(gc, name, value)
        return gc

    def _cut_at_end(self, new: Any) -> Any:
        import torch

        is_end = torch.isin(new, torch.tensor(self._eos_ids, device=new.device))
        if bool(is_end.any()):
            first = int(is_end.nonzero()[0, 0])
            return new[: first + 1]  # keep the end token: it carries the length signal
        return new


def _stopping(check: StopCheck | None, width: int) -> Any:
    """``generate()``'s stopping criteria for ``check`` on rows whose new tokens begin at ``width``
    (None: none, and generate checks nothing more per token)."""
    if check is None or not check:
        return None
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    ask: StopCheck = check

    class _Stops(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = [ask(row, ids[width:]) for row, ids in enumerate(input_ids.tolist())]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Stops()])


class _TextPieces:
    """A ``generate()`` streamer that hands each newly decoded piece of the answer to ``on_text`` as each
    token comes (the prompt, passed first, skipped); text that ends in half a UTF-8 character waits for
    the rest. transformers' TextStreamer holds whole words back for a console; a page wants tokens."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None]) -> None:
        self.tokenizer, self.on_text = tokenizer, on_text
        self.reset()

    def reset(self) -> None:
        """Ready for a fresh answer (another engine draws it again from the start)."""
        self.ids: list[int] = []
        self.sent = 0  # characters of the decoded answer handed over so far
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(i) for i in (value.reshape(-1).tolist() if hasattr(value, "reshape") else value))
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)

    def _flush(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            return
        if len(text) > self.sent:
            piece, self.sent = text[self.sent:], len(text)
            self.on_text(piece)


def batch_token_logprobs(model: Any, prompts: Sequence[Any], news: Sequence[Any], pad_id: int) -> list[list[float]]:
    """Raw log p(answer token | prompt, answer so far) for many answers in one forward pass: each row
    ``prompt + answer`` (less its last token). The prefix every row shares (a system prompt) runs once,
    its keys and values lent to every row; the rest of each row is left-padded to one width, with
    position ids counted on from the prefix over its real tokens, so each row sees what it would alone."""
    import torch
    from transformers import DynamicCache

    from .models import cache_argument

    rows = [torch.cat([p, n])[:-1] if n.numel() else p[:0] for p, n in zip(prompts, news, strict=True)]
    keep = max((int(n.numel()) for n in news), default=0)
    if keep == 0:
        return [[] for _ in news]
    device = rows[0].device
    # Shared: at most every prompt but its last token, so each row's scored positions come after it.
    shared = min(int(p.numel()) for p, n in zip(prompts, news, strict=True) if n.numel()) - 1
    lists = [r.tolist() for r in rows if r.numel()]
    shared = min([shared] + [llamacpp_engine.shared_prefix(lists[0], r) for r in lists[1:]])
    if len(lists) < 2 or shared < 8:  # too little to share: not worth a second call
        shared = 0
    tails = [r[shared:] if r.numel() else r for r in rows]
    width = max(int(t.numel()) for t in tails)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, t in enumerate(tails):
        if t.numel():
            ids[i, width - t.numel():] = t
            mask[i, width - t.numel():] = 1
    positions = shared + (mask.cumsum(-1) - 1).clamp(min=0)
    extra: dict[str, Any] = {"use_cache": False}
    with torch.inference_mode():
        if shared:
            cache = DynamicCache(config=model.config)
            model(input_ids=rows[0][:shared].unsqueeze(0), use_cache=True, **{cache_argument(model): cache})
            cache.batch_repeat_interleave(len(rows))
            mask = torch.cat([torch.ones((len(rows), shared), dtype=torch.long, device=device), mask], dim=1)
            extra = {"use_cache": True, cache_argument(model): cache}
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep,
                       **extra).logits[:, -keep:]
        logp = torch.log_softmax(logits.float(), dim=-1)
    out: list[list[float]] = []
    for i, n in enumerate(news):
        k = int(n.numel())
        if k == 0:
            out.append([])
            continue
        out.append(logp[i, keep - k:].gather(-1, n.view(-1, 1)).squeeze(-1).tolist())
    return out


def left_padded(rows: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """``rows`` of token ids as ``[B, W]`` id and attention-mask tensors, padded on the left: every row's
    next token is generated at the same column."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[int(pad_id)] * (width - len(r)) + list(r) for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


@contextmanager
def seeded_rng(seed: int | None, device: str) -> Iterator[None]:
    """Seed sampling for one answer without disturbing the process-wide RNG state."""
    if seed is None:
        yield
        return
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        devices, device_type = [], "cuda"
    else:
        devices, device_type = [dev.index or 0], dev.type
    with torch.random.fork_rng(devices=devices, device_type=device_type):
        torch.manual_seed(seed)
        yield


def responder_for(cfg: Config) -> LocalResponder:
    """The data dir's model as its chat settings answer with it: what `rlfleet serve`, `rlfleet chat`
    and `rlfleet web` hold."""
    from .models import resolve_model, serving_device
    from .registry import AdapterRegistry

    ref = resolve_model(cfg.model)
    return LocalResponder(ref, AdapterRegistry(cfg.adapters_root, ref.slug).dir,
                          device=serving_device(cfg.train.device), max_new_tokens=cfg.chat.max_new_tokens,
                          temperature=cfg.chat.temperature, top_p=cfg.chat.top_p,
                          system_prompt=cfg.chat.system_prompt, scope_fallback=cfg.train.scope_parent == "shared",
                          engine=cfg.chat.engine)
