"""The torch + peft backend: :class:`Trainer`.

The base model is loaded once per :class:`Trainer` and kept between runs. Each run wraps it with a
LoRA (fresh, or the parent adapter's weights so the lineage continues) and unwraps it afterwards,
so the base is clean for the next run. Not thread-safe: a run mutates the base's modules in place
(inside a run, :meth:`Trainer.each` runs a pass's micro-batches on threads of its own: :mod:`.parallel`).

Log-probs are computed in fp32. The forward passes of an adapter session run under bf16 autocast
when its ``precision`` resolves to bf16 (:mod:`.precision`: a GPU, or a CPU with native bf16); a
run's behaviour, reference and policy log-probs then share those numerics (see
:func:`.policy_gradient._fixed_logprobs` for the recorded ones).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from rlfleet.shared import allocator
from rlfleet.shared.chat_prompt import prompt_ids
from rlfleet.shared.models import (
    ModelRef,
    cache_argument,
    end_token_ids,
    load_model,
    load_tokenizer,
    quiet_peft,
    tuner_layers,
)
from rlfleet.shared.registry import ADAPTER_WEIGHTS
from rlfleet.shared.responder import left_padded, sampling, seeded_rng

from ..batching import Encoded, collate, fold_hosts, micro_batches, shared_prefix
from ..objective import (
    entropy_excess,
    hindsight_kl,
    k3_kl,
    loss_for,
    next_token_entropy,
    per_answer_mean,
    top_k_kl,
    unlikelihood,
)
from ..presets import TrainConfig
from . import decoding, feature_memo, grouped_attention
from .backend import FromStep, RefExtras, RowScores, StepStats, TokenSums, TopRow
from .drawing import LIVE, Drawer, Weights
from .interface import TrainerInterface
from .parallel import MicroBatchPool, auto_workers
from .precision import effective
from .teachers import TeacherCache
from .token_logprobs import token_logprobs

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

# Config fields that change logits after the output head: with any of them set the cheap path
# (output head on response positions only) would be wrong, so full logits are used instead.
_LOGIT_POSTPROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


class Trainer(TrainerInterface):
    def __init__(self, ref: ModelRef, device: str = "cpu") -> None:
        self._attach(ref, device, load_tokenizer(ref), load_model(ref, device))

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, device: str, ref: ModelRef | None = None) -> Trainer:
        """A Trainer around a model already in memory (the benchmarks build random-init ones)."""
        self = cls.__new__(cls)
        ref = ref or ModelRef(spec="in-memory", path="", gguf_file=None, slug="in-memory")
        self._attach(ref, device, tokenizer, model.to(device).eval())
        return self

    def _attach(self, ref: ModelRef, device: str, tokenizer: Any, base: Any) -> None:
        self.ref = ref
        self.device = device
        self.tokenizer = tokenizer
        self.base = _read_only(base, device)  # the base is never trained; only LoRA weights are
        self._n_params = sum(p.numel() for p in self.base.parameters())
        text = getattr(base.config, "get_text_config", lambda: base.config)()
        self._width: int | None = getattr(text, "hidden_size", None)
        self._model: Any = None  # the LoRA-wrapped base while an adapter session is open
        self._bf16 = False  # bf16 autocast in this session's forward passes
        self._lora: list[Any] = []  # the session's LoRA layers (see autocast)
        self._frozen = FrozenWeights()  # a bf16 session's frozen weights, held in bf16 (see autocast)
        self._half_head = HalfHead()  # a bf16 session's output head (see _head_logits)
        self._loss: Any = None
        self._opt: Any = None
        self._params: list[Tensor] = []
        self._grad_clip = 0.0
        self._hindsight = 0.0
        self._teachers = TeacherCache(tokenizer)
        self._override: Any = None  # the model forward passes use instead (a hindsight teacher)
        self._share_prefix = True  # off once a model's forward refuses a shared prefix's cache
        self._weights: Weights = None  # what the active model's weights are on disk (drawing.LIVE: nothing)
        # What the session's weights are remembered under (feature_memo.identity), per weights in use:
        # the feature passes keep each row's response log-probs there beside the hidden states
        # (:meth:`_remember`), and :meth:`logprobs` reads them, in this session or a later one.
        self._identities: dict[Path | None, feature_memo.Identity] = {}
        # torch's draws run in bf16 wherever it is native, whatever the sessions train in: a draw is
        # read for its tokens, whose behaviour log-probs a run computes itself.
        self._draw_bf16 = effective("auto", device, self._width) == "bf16"
        self._decodes = True  # off once the model's forward refuses decoding.draw (generate draws then)
        self._drawer = Drawer(ref, device, end_token_ids(base, tokenizer))
        self._parallel: int | None = None  # train.parallel_batches (None: auto_workers decides)
        self._pool = MicroBatchPool()
        # The LoRA layers' input casts are off while any pass is under autocast (see autocast): with
        # micro-batches on several threads the last one out turns them back on.
        self._casts_lock = threading.Lock()
        self._casts_off = 0

    def draw_with(self, engine: str, load: bool = False) -> None:
        """What draws the answers this trainer samples (``chat.engine``; see :mod:`.drawing`);
        ``load``: load llama.cpp now (the worker's preload) rather than at the run's first draw."""
        self._drawer.choose(engine)
        if load:
            self._drawer.load()

    def parallel_batches(self, workers: int | None) -> None:
        """How many micro-batches a session's passes run at once (``train.parallel_batches``; None:
        :func:`.parallel.auto_workers`), from the next session on."""
        self._parallel = workers

    def each(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        return self._pool.map(fn, items, self._params)

    @property
    def drawer(self) -> Drawer:
        return self._drawer

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def is_moe(self) -> bool:
        cfg = self.base.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        return bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))

    def _active(self) -> Any:
        if self._override is not None:
            return self._override
        return self.base if self._model is None else self._model

    # -- model state ------------------------------------------------------------------------------

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    @contextlib.contextmanager
    def adapter(
        self, adapter_dir: Path | None, cfg: TrainConfig | None, trainable: bool = False, precision: str = "fp32"
    ) -> Iterator[Any]:
        """The base wrapped with a LoRA for the duration of the block (the peft model is yielded);
        the base is clean afterwards.

        With ``adapter_dir`` the adapter's own config (rank, alpha, modules: a lineage keeps its
        shape) and weights are loaded; otherwise a fresh LoRA from ``cfg`` (B = 0, so it starts
        equal to the base). Weights are loaded after wrapping, inside the ``try``, so a bad file
        still leaves the base clean.
        """
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        if adapter_dir is not None:
            lora = LoraConfig.from_pretrained(str(adapter_dir))
        elif cfg is not None:
            lora = LoraConfig(
                r=cfg.rank,
                lora_alpha=cfg.alpha,
                target_modules="all-linear",
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
            )
        else:
            raise ValueError("a fresh adapter needs a TrainConfig")
        lora.inference_mode = not trainable
        with quiet_peft():
            model = get_peft_model(self.base, lora)
        try:
            if adapter_dir is not None:
                weights = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS), device=self.device)
                # peft annotates the result `namedtuple` (the factory, not a type); it is torch's
                # load_state_dict result, with missing_keys and unexpected_keys
                loaded: Any = set_peft_model_state_dict(model, weights)
                missing = [k for k in loaded.missing_keys if "lora_" in k]
                if loaded.unexpected_keys or missing:
                    raise ValueError(
                        f"adapter {adapter_dir} does not fit {self.ref.spec}: "
                        f"unexpected {loaded.unexpected_keys[:3]}, missing {missing[:3]}"
                    )
            # Eval mode while training too: dropout or router noise would make the trained policy
            # differ from the one the behaviour and reference log-probs were computed with.
            model.eval()
            self._model, self._lora = model, tuner_layers(model)
            spare = spare_memory()  # one reading for both of the session's memory decisions below
            self._bf16 = self.resolved_precision(precision) == "bf16"
            # Decided once a session, so that a run's passes all split their micro-batches alike.
            self._pool.resize(self._parallel or auto_workers(
                self.device.split(":")[0], torch.get_num_threads(), spare,
                sum(p.numel() * p.element_size() for p in self.base.parameters()), self.precision))
            if self._bf16 and self.device == "cpu":  # (on a GPU the casts cost little, memory more)
                self._frozen = FrozenWeights.of(self._lora, spare // 4)
                self._frozen.hold(half=True)
            # A fresh LoRA (B = 0) is the base until its first step.
            self._weights = Path(adapter_dir) if adapter_dir is not None else None
            yield model
        finally:
            self._frozen.hold(half=False)  # the base's own fp32 weights back before anything else
            self._frozen = FrozenWeights()
            self._model, self._lora, self._bf16, self._opt, self._params = None, [], False, None, []
            self._weights, self._identities = None, {}
            self._pool.resize(1)  # outside a session a pass runs in the caller's thread
            model.unload()  # removes the LoRA layers without merging them: the base is untouched
            self.base.eval()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        weights, self._weights = self._weights, None
        try:
            with self._model.disable_adapter():
                yield
        finally:
            self._weights = weights

    @contextlib.contextmanager
    def teacher(self, spec: str | None) -> Iterator[None]:
        if spec is None:
            with self.reference():
                yield
            return
        self._override = self._teachers.get(spec, self._load_teacher)
        try:
            yield
        finally:
            self._override = None

    def _load_teacher(self, ref: ModelRef) -> Any:
        return _read_only(load_model(ref, self.device), self.device)

    def save(self, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with quiet_peft():
            self._model.save_pretrained(str(out_dir))
        self._weights = out_dir

    @contextlib.contextmanager
    def _saved_live(self) -> Iterator[Path]:
        """The session's adapter as it is now, saved to a private folder for the block (a LoRA of the
        default model saves in a tenth of a second; llama.cpp holds it once it has drawn from it)."""
        folder = Path(tempfile.mkdtemp(prefix="rlfleet-live-adapter-"))
        try:
            with quiet_peft():
                self._model.save_pretrained(str(folder))
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @property
    def precision(self) -> str:
        return "bf16" if self._bf16 else "fp32"

    def resolved_precision(self, precision: str) -> str:
        """What a session opened with ``precision`` computes in, on this trainer's device and model."""
        return effective(precision, self.device, self._width)

    @property
    def step_stands_in(self) -> bool:
        return True

    @property
    def rows_seeded(self) -> bool:
        # llama.cpp and decoding.draw seed each row; transformers' generate (a model whose logits are
        # rescaled after its head) draws one stream for the whole batch.
        own = self._decodes and _decoder(self._active()) is not None
        return own or (self._override is None and self._drawer.engine == "llama.cpp")

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """bf16 autocast where this session allows it, else nothing.

        Under autocast peft's LoRA layers would cast a bf16 input up to their fp32 weights' type, and
        autocast cast it straight back down for the product: two elementwise passes over every
        adapted layer's input, forward and backward, for bit-identical results. They are left out
        while the block runs (a LoRA layer's input then goes to its product as it is). Likewise
        autocast would cast every frozen weight to bf16 again on every forward pass (it keeps only
        the casts of weights that train): a bf16 session on a CPU with the memory to spare holds the
        adapted layers' frozen weights in bf16 from its start (:class:`FrozenWeights`), rounded as
        autocast rounds them, so the products are the same."""
        if not self._bf16:
            yield
            return
        with torch.autocast(device_type=self.device.split(":")[0], dtype=torch.bfloat16):
            self._lora_casts(off=True)
            try:
                yield
            finally:
                self._lora_casts(off=False)

    def _lora_casts(self, off: bool) -> None:
        with self._casts_lock:
            self._casts_off += 1 if off else -1
            if self._casts_off == (1 if off else 0):
                for layer in self._lora:
                    layer.cast_input_dtype_enabled = not off

    @contextlib.contextmanager
    def _drawing(self) -> Iterator[None]:
        """The active model as draws run it: in bf16 where that is native (:attr:`_draw_bf16`), with the
        frozen weights held in bf16 for the block where the session does not hold them already; in
        fp32 elsewhere."""
        if not self._draw_bf16:
            with self.full_precision():
                yield
            return
        bf16, frozen = self._bf16, self._frozen
        # A decoding step multiplies a few rows by each matrix: the LoRA's two thin products beside
        # the frozen one would double it, so on a CPU the adapter is folded into the bf16 copies
        # (W + scale·BA, rounded once) and the LoRA layers pass their input to them alone.
        fold = self.device == "cpu" and _foldable(self._lora)
        drawn = frozen
        if self.device == "cpu" and (fold or not bf16):
            frozen.hold(half=False)  # the copies are made from the fp32 weights
            drawn = FrozenWeights.of(self._lora or _frozen_linears(self.base), spare_memory() // 4, fold=fold)
        self._frozen, self._bf16 = drawn, True
        drawn.hold(half=True)
        try:
            with self.autocast(), _adapters_off(self._lora if fold and len(drawn) else []):
                yield
        finally:
            drawn.hold(half=False)
            self._frozen, self._bf16 = frozen, bf16
            frozen.hold(half=bf16)

    @contextlib.contextmanager
    def full_precision(self) -> Iterator[None]:
        bf16, self._bf16 = self._bf16, False
        self._frozen.hold(half=False)
        try:
            yield
        finally:
            self._bf16 = bf16
            self._frozen.hold(half=bf16)

    # -- tensors ----------------------------------------------------------------------------------

    def batches(self, encoded: Sequence[Encoded], budget: int) -> tuple[list[list[int]], list[dict]]:
        hosts = fold_hosts(encoded)
        groups = micro_batches(encoded, budget, share_prefix=True, hosts=hosts)
        pad = self.tokenizer.pad_token_id
        tensors = []
        for g in groups:
            items = [encoded[i] for i in g]
            batch = {k: v.to(self.device) for k, v in collate(items, pad).items()}
            # what every pass over the batch encodes once (a CPU scalar: read without a device sync)
            batch["shared_prefix"] = torch.tensor(shared_prefix(items))
            run = [row for row, i in enumerate(g) if hosts[i] == i]
            if len(run) < len(g):  # rows read from their host's pass (fold_hosts): only the hosts run
                at = {g[row]: k for k, row in enumerate(run)}
                batch["run_rows"] = torch.tensor(run, device=self.device)
                batch["row_host"] = torch.tensor([at[hosts[i]] for i in g], device=self.device)
            tensors.append(batch)
        return groups, tensors

    def vector(self, values: Sequence[float]) -> Tensor:
        return torch.tensor(list(values), dtype=torch.float32, device=self.device)

    def _response_logits(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``[N, V]`` fp32 next-token logits at the N response positions (row-major over the batch's
        response mask) and the token each predicts.

        Where the architecture allows, the output head runs on response positions only (hidden
        states are sliced first): the prompt's logits are never needed and cost vocab-sized rows.
        """
        lm, body = _lm_and_body(self._active())
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        if bool(resp[:, 0].any()):
            raise ValueError("a response token at position 0 has no context to be predicted from")
        # Token t is predicted from position t-1.
        pred_mask = resp[:, 1:]
        targets = ids[:, 1:][pred_mask]

        head = _plain_head(lm)
        split = body is not None and head is not None
        p = int(batch.get("shared_prefix", 0)) if self._share_prefix else 0
        run = batch.get("run_rows")  # None: every row runs (see batches)
        run_ids, run_attn = (ids, attn) if run is None else (ids[run], attn[run])
        try:
            with self.autocast():
                out = _forward(body if split else lm, run_ids, run_attn, p)
        except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
            if p == 0:
                raise
            # An architecture whose forward takes no key/value cache this way: every row whole, as before.
            log.warning("%s cannot share a prompt's keys and values (%s: %s); training encodes each row whole",
                        self.ref.spec, type(exc).__name__, exc)
            self._share_prefix, p = False, 0
            with self.autocast():
                out = _forward(body if split else lm, run_ids, run_attn, 0)
        pred_mask = pred_mask[:, p:]  # the positions the pass computed: p onwards
        # Each predicting position in row-major order (the mask's), read from the row that ran it: the
        # row itself, or its host (see batches).
        rows, cols = pred_mask.nonzero(as_tuple=True)
        ran = rows if run is None else batch["row_host"][rows]
        states = (out.last_hidden_state if split else out.logits)[ran, cols]
        if split and head is not None:
            logits = self._head_logits(head, states)
        else:
            logits = states.float()
        return logits, targets

    def _head_logits(self, head: torch.nn.Linear, states: Tensor) -> Tensor:
        """The session's fp32 logits of ``head`` over ``states`` (:func:`_head_logits`, on the bf16 head
        in a bf16 session): every pass that reads the head reads it here."""
        return _head_logits(head, states, self._half_head if self._bf16 else None)

    def _scatter(self, batch: dict[str, Tensor], values: Tensor) -> Tensor:
        """``[N]`` values at the response positions as ``[B, L]``, 0 elsewhere."""
        resp = batch["response_mask"]
        # Boolean-mask order is row-major, the same order masked_scatter fills in.
        return torch.zeros(resp.shape, dtype=torch.float32, device=resp.device).masked_scatter(resp, values)

    def _logits_and_logprobs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The response positions' ``[N, V]`` logits and ``[N, 1]`` logsumexp, and the ``[B, L]`` fp32
        log-prob of each response token given its prefix (0 off the response mask)."""
        logits, targets = self._response_logits(batch)
        lp, lse = token_logprobs(logits, targets)
        return logits, lse, self._scatter(batch, lp)

    def _logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        """``[B, L]`` fp32 log-prob of each response token given its prefix; 0 off the response mask."""
        return self._logits_and_logprobs(batch)[2]

    @torch.no_grad()
    def reference_logprobs(self, batch: dict[str, Tensor], top_k: int = 0,
                           entropy: bool = False) -> tuple[Tensor, RefExtras]:
        logits, lse, lp = self._logits_and_logprobs(batch)
        top = None
        if top_k:
            top_logits, top_ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
            top = (top_ids, top_logits - lse)
        return lp, RefExtras(top=top, entropy=next_token_entropy(logits, lse) if entropy else None)

    @torch.no_grad()
    def response_top(self, batch: dict[str, Tensor], top_k: int) -> list[TopRow]:
        logits, targets = self._response_logits(batch)
        token, lse = token_logprobs(logits, targets)
        top_logits, top_ids = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
        counts = batch["response_mask"].sum(dim=1).tolist()
        rows = zip(top_ids.split(counts), (top_logits - lse).split(counts), token.split(counts), strict=True)
        return [TopRow(i.cpu().numpy(), lp.cpu().numpy(), t.cpu().numpy()) for i, lp, t in rows]

    def teacher_targets(
        self, batch: dict[str, Tensor], rows: Sequence[tuple[TopRow, float] | None]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``[N, K]`` ids and log-probs and ``[N]`` weights over the batch's response positions, in
        row-major order (the order :meth:`_response_logits` yields them in)."""
        counts = batch["response_mask"].sum(dim=1).tolist()
        k = next(r[0].ids.shape[1] for r in rows if r is not None)
        ids, lps, weights = [], [], []
        for n, row in zip(counts, rows, strict=True):
            if row is None:  # filler with weight 0: finite values, so 0 * KL stays 0
                ids.append(torch.zeros((n, k), dtype=torch.long))
                lps.append(torch.full((n, k), -30.0))
                weights.append(torch.zeros(n))
                continue
            top, weight = row
            if top.ids.shape[0] != n:
                raise ValueError(f"a teacher row has {top.ids.shape[0]} positions, its answer {n}")
            ids.append(torch.as_tensor(top.ids, dtype=torch.long))
            lps.append(torch.as_tensor(top.logprobs, dtype=torch.float32))
            weights.append(torch.full((n,), float(weight)))
        return (torch.cat(ids).to(self.device), torch.cat(lps).to(self.device), torch.cat(weights).to(self.device))

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Tensor]) -> Tensor:
        known = self._recall(batch)
        return self._logprobs(batch) if known is None else known

    def _known(self, create: bool = True) -> feature_memo.Rows | None:
        """The remembered log-probs of the active model (None: not remembered at all): of the weights on
        disk it is (None: the base, which a fresh LoRA is until its first update), inside a session only.
        Not weights that an update has moved, and not a teacher. In a bf16 session a row's values depend
        on the batch it was computed in, and the run's ratios start at exactly 1 only when the behaviour
        pass and the policy's first pass share their batches (:mod:`.precision`): there only the base's
        are remembered. In a session that continues a saved adapter the base is the KL anchor alone (the
        behaviour is the run-start pass, run in the run's own batches), and another batch's rounding
        moves the anchor by a rounding error. In a fresh LoRA's session the base is the behaviour too,
        but the micro-batches the first step trains take both from that step's own pass
        (:class:`.backend.FromStep`, never from here), and the others first train after an update has
        moved the policy, their ratios already off 1 by far more than a rounding error. ``create`` off:
        None where nothing is remembered yet."""
        weights = self._weights
        if self._model is None or self._override is not None or not (
                weights is None or isinstance(weights, Path)):  # (LIVE: moved by an update)
            return None
        if self._bf16 and weights is not None:
            return None
        if weights not in self._identities:
            self._identities[weights] = feature_memo.identity(weights, self.precision)
        memo = feature_memo.memo_of(self, self._identities[weights], create)
        return None if memo is None else memo.logprobs

    def _remember(self, lm: Any, batch: dict[str, Tensor], hidden: Tensor,
                  endings: Sequence[Sequence[int]] = ()) -> None:
        """Keep each row's response log-probs from ``hidden`` (the last hidden layer of a pass over
        ``batch``'s rows), and each ending's (:meth:`pooled_endings`: the row's first k answer tokens
        then the end token): the reference and behaviour passes then need no forward of their own
        for the rows the feature passes already ran (exploration's answers, the rated ones), in the
        run or, where the worker pooled them while it waited, before it."""
        known = self._known()
        head = _plain_head(lm)
        if known is None or head is None:
            return
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        eos = int(self.tokenizer.eos_token_id)
        for r in range(ids.shape[0]):
            n = int(attn[r].sum())
            start = int(resp[r].int().argmax())
            if start == 0:  # no answer in the row, or one with nothing to be predicted from
                continue
            row = ids[r, :n].tolist()
            # Positions start-1 .. n-1: each predicts the token after it (the last one, an ending's end).
            # (The feature passes call this inside their autocast: the head's logits are the step's all the same.)
            logits = self._head_logits(head, hidden[r, start - 1:n])
            targets = torch.tensor(row[start:] + [eos], device=logits.device)
            token, lse = token_logprobs(logits, targets)
            lp = token.tolist()
            known[(start, tuple(row))] = lp[:-1]
            for k in (endings[r] if endings else ()):
                k = int(k)
                eos_lp = float(logits[k, eos] - lse[k, 0])
                known[(start, tuple(row[:start + k] + [eos]))] = lp[:k] + [eos_lp]

    def _recall(self, batch: dict[str, Tensor]) -> Tensor | None:
        """``batch``'s ``[B, L]`` log-probs where every row's are remembered for the active model
        (:meth:`_remember`), else None."""
        known = self._known(create=False)
        if not known:
            return None
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        values: list[float] = []
        for r in range(ids.shape[0]):
            key = (int(resp[r].int().argmax()), tuple(ids[r, :int(attn[r].sum())].tolist()))
            if key not in known:
                return None
            values += known[key]
        return self._scatter(batch, torch.tensor(values, dtype=torch.float32, device=ids.device))

    def with_recorded(
        self, logprobs: Tensor, rows: Sequence[tuple[int, int, Sequence[float]]], shift: Tensor | None = None
    ) -> Tensor:
        out = logprobs.clone()
        for row, start, values in rows:
            end = start + len(values)
            out[row, start:end] = torch.tensor(list(values), dtype=out.dtype, device=out.device)
            if shift is not None:
                out[row, start:end] += shift[row, start:end]
        return out

    @torch.no_grad()
    def kl_sum(self, batch: dict[str, Tensor], ref: Tensor) -> tuple[float, float]:
        mask = batch["response_mask"]
        new = self._logprobs(batch)
        return float(k3_kl(new[mask], ref[mask]).sum()), int(mask.sum())

    # -- optimizer --------------------------------------------------------------------------------

    def begin_training(self, cfg: TrainConfig) -> None:
        self._loss = loss_for(cfg)
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._opt = torch.optim.AdamW(self._params, lr=cfg.lr)
        self._grad_clip = cfg.grad_clip
        self._entropy_hinge = cfg.entropy_hinge
        self._hindsight = cfg.hindsight

    def begin_step(self) -> None:
        self._opt.zero_grad(set_to_none=True)
        # What the last step freed goes back to the kernel now: the worker's mimalloc keeps freed blocks
        # (rlfleet.shared.allocator), and a run's blocks, of sizes that differ from one micro-batch to
        # the next, would otherwise pile up over its steps; within a step they are reused.
        allocator.release()

    def accumulate(
        self,
        batch: dict[str, Tensor],
        beh: Tensor | FromStep,
        ref: Tensor | None,
        advantages: Tensor,
        share: float,
        extras: RefExtras | None = None,
    ) -> StepStats:
        logits, lse, logp = self._logits_and_logprobs(batch)
        fixed = None
        if isinstance(beh, FromStep):
            own = logp.detach()
            ref = own if beh.reference else ref
            beh = self.with_recorded(own, beh.recorded, None if beh.full is None else own - beh.full)
            fixed = (beh, ref)
        if ref is None:
            raise ValueError("accumulate needs the reference log-probs, or a FromStep beh that gives them")
        anchor = excess = distill = None
        if extras is not None and extras.top is not None:
            top_ids, top_ref = extras.top
            anchor = self._scatter(batch, top_k_kl(logits.gather(-1, top_ids) - lse, top_ref))
        out = self._loss(logp, beh, ref, batch["response_mask"], advantages, anchor=anchor)
        loss = out.loss
        if extras is not None and extras.entropy is not None:
            # A mean over the micro-batch's response positions (the rows are already those positions).
            excess = entropy_excess(next_token_entropy(logits, lse), extras.entropy).mean()
            loss = loss + self._entropy_hinge * excess
        if extras is not None and extras.teacher is not None:
            t_ids, t_lp, weights = extras.teacher
            student = logits.gather(-1, t_ids) - lse
            distill = per_answer_mean(hindsight_kl(student, t_lp), weights, batch["input_ids"].shape[0])
            loss = loss + self._hindsight * distill
        self._pool.backward(loss * share, self._params)
        return StepStats(
            loss=float(out.loss.detach()),
            mean_kl=out.mean_kl,
            n_tokens=out.n_tokens,
            accepted_tokens=out.accepted_token_frac * out.n_tokens,
            accepted_seqs=out.accepted_seq_frac * batch["input_ids"].shape[0],
            anchor_kl=out.anchor_kl,
            entropy_excess=None if excess is None else float(excess.detach()),
            hindsight_kl=None if distill is None else float(distill.detach()),
            fixed=fixed,
        )

    def accumulate_unlikelihood(
        self, batch: dict[str, Tensor], marks: Sequence[tuple[int, int, Sequence[int]]], weight: float, share: float
    ) -> float:
        hit = torch.zeros_like(batch["response_mask"])
        for row, start, positions in marks:
            hit[row, [start + t for t in positions]] = True
        if not bool(hit.any()):
            return 0.0  # nothing marked: the term and its gradient are 0
        # The term reads the marked tokens' log-probs alone (the others only count the answer's tokens):
        # the head runs at them alone, and the pass stops at the last one (nothing after a position
        # changes its hidden state).
        logp = self._logprobs(_marked_only(batch, hit))
        logp = torch.nn.functional.pad(logp, (0, hit.shape[1] - logp.shape[1]))
        loss = unlikelihood(logp, batch["response_mask"], hit)
        self._pool.backward(loss * (weight * share), self._params)
        return float(loss.detach())

    def finish_step(self, apply: bool) -> None:
        torch.nn.utils.clip_grad_norm_(self._params, self._grad_clip)
        if apply:
            self._opt.step()
            self._weights = LIVE

    # -- measurements -----------------------------------------------------------------------------

    def response_logprobs(self, batch: dict[str, Tensor]) -> list[list[float]]:
        lp = self.logprobs(batch)
        return [lp[row][batch["response_mask"][row]].tolist() for row in range(lp.shape[0])]

    @torch.no_grad()
    def pooled_hidden(self, batch: dict[str, Tensor]) -> list[list[float]]:
        lm, body = _lm_and_body(self._active())
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        with self.autocast():
            if body is not None:  # the transformer without its output head: no vocab-sized logits
                hidden = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
                self._remember(lm, batch, hidden)
            else:
                out = lm(input_ids=ids, attention_mask=attn, use_cache=False, output_hidden_states=True)
                hidden = out.hidden_states[-1]
        mask = resp.unsqueeze(-1).to(torch.float32)
        pooled = (hidden.float() * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return pooled.cpu().tolist()

    @torch.no_grad()
    def pooled_endings(self, batch: dict[str, Tensor], endings: Sequence[Sequence[int]]
                       ) -> tuple[list[list[float]], list[list[list[float]]]]:
        """In one pass (a custom attention mask): the rows' own pooled vectors, and each ending's: row
        r's answer ended after its first ``endings[r][j]`` tokens, the end token after them. The row's
        hidden states at those tokens are the ending's (the model is causal); only the end token is
        new, an extra position that sees the ending's tokens and itself."""
        lm, body = _lm_and_body(self._active())
        if body is None or not grouped_attention.custom_masks(lm):
            raise NotImplementedError("the model takes no custom attention mask this way")
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        rows, width = ids.shape
        extra = max((len(e) for e in endings), default=0)
        total = width + extra
        eos = self.tokenizer.eos_token_id
        lengths = attn.sum(1).tolist()
        starts = resp.int().argmax(1).tolist()  # each row's first response position
        full_ids = torch.cat([ids, torch.full((rows, extra), int(eos), dtype=ids.dtype, device=ids.device)], 1)
        positions = torch.arange(total, device=ids.device).repeat(rows, 1)
        keys = torch.arange(total, device=ids.device)
        allowed = keys[None, :] <= keys[:, None]  # causal over the row's own positions
        mask = allowed[None].repeat(rows, 1, 1)
        for r in range(rows):
            mask[r, :, lengths[r]:width] = False  # padding is never a key
            for j in range(extra):
                q = width + j
                mask[r, q] = False
                mask[r, q, q] = True
                if j < len(endings[r]):
                    end = starts[r] + int(endings[r][j])
                    if not 0 < endings[r][j] <= lengths[r] - starts[r]:
                        raise ValueError(f"ending {endings[r][j]} is outside row {r}'s answer")
                    mask[r, q, :end] = True
                    positions[r, q] = end
        with self.autocast():
            hidden = body(input_ids=full_ids, attention_mask=mask[:, None], position_ids=positions,
                          use_cache=False).last_hidden_state
            self._remember(lm, batch, hidden[:, :width], endings)
        hidden = hidden.float()
        on = resp.unsqueeze(-1).to(torch.float32)
        own = (hidden[:, :width] * on).sum(1) / on.sum(1).clamp(min=1.0)
        # Per row, the running sum of its hidden states over the answer: an ending's tokens are a prefix.
        running = (hidden[:, :width] * on).cumsum(1)
        ended: list[list[list[float]]] = []
        for r in range(rows):
            vectors = []
            for j, k in enumerate(endings[r]):
                k = int(k)
                vectors.append(((running[r, starts[r] + k - 1] + hidden[r, width + j]) / (k + 1)).tolist())
            ended.append(vectors)
        return own.tolist(), ended

    @torch.no_grad()
    def score_rows(self, batch: dict[str, Tensor], with_kl: bool) -> list[RowScores]:
        # The output head on answer positions only (and a shared prompt once): the prompt's
        # vocabulary-sized rows are never read.
        logits, targets = self._response_logits(batch)
        logp = torch.log_softmax(logits, dim=-1)
        counts = torch.bincount(_rows_of_positions(batch), minlength=batch["input_ids"].shape[0]).tolist()

        def sums(lp: Tensor, kl: Tensor | None, p: Tensor | None = None) -> list[TokenSums]:
            p = lp.exp() if p is None else p
            ent = -(p * lp).sum(-1)
            tok = lp.gather(-1, targets[:, None]).squeeze(-1)
            per_kl = _per_row(batch, kl) if kl is not None else [0.0] * len(counts)
            return [TokenSums(t, e, d, int(n)) for t, e, d, n in zip(
                _per_row(batch, tok), _per_row(batch, ent), per_kl, counts, strict=True)]

        if not with_kl:
            return [RowScores(row) for row in sums(logp, None)]
        with self.reference():
            ref = torch.log_softmax(self._response_logits(batch)[0], dim=-1)
        p = logp.exp()  # the entropy and the KL read the same vocabulary-wide exp
        model = sums(logp, (p * (logp - ref)).sum(-1), p)
        return [RowScores(m, b) for m, b in zip(model, sums(ref, None), strict=True)]

    @torch.no_grad()
    def teacher_divergence(self, batch: dict[str, Tensor], targets: tuple[Tensor, Tensor, Tensor]
                           ) -> list[tuple[float, int]]:
        logits, _ = self._response_logits(batch)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        t_ids, t_lp, weights = targets
        kl = hindsight_kl(logits.gather(-1, t_ids) - lse, t_lp) * weights
        return [(v, int(n)) for v, n in zip(_per_row(batch, kl), _per_row(batch, weights > 0), strict=True)]

    @torch.no_grad()
    def sample(
        self, prompts: Sequence[list[dict]], max_new_tokens: int, seed: int,
        temperature: float = 0.7, top_p: float = 1.0, seeds: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """The prompts' answers drawn in one batch at the chat's ``temperature`` and ``top_p``, each row
        from a stream of its own (``seeds``, or ``seed + i``): llama.cpp's batch where it draws from
        these weights (:mod:`.drawing`), else this model's (:func:`.decoding.draw`; transformers'
        ``generate``, one stream from ``seed``, for a model whose logits its head alone does not give)."""
        tok = self.tokenizer
        eos = tok.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        rows = [prompt_ids(tok, p) for p in prompts]
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"{len(rows)} prompts but {len(seeds)} seeds")
        if self._override is None:  # (a stronger teacher is a model llama.cpp does not hold)
            if self._weights is LIVE and self._drawer.engine == "llama.cpp":
                with self._saved_live() as folder:  # the loop checks: llama.cpp draws from a folder
                    drawn = self._drawer.draw(rows, max_new_tokens, seed, temperature, top_p, folder, seeds)
            else:
                drawn = self._drawer.draw(rows, max_new_tokens, seed, temperature, top_p, self._weights, seeds)
            if drawn is not None:
                return drawn
        decoder = _decoder(self._active()) if self._decodes else None
        if decoder is not None:
            body, head = decoder
            own = list(seeds) if seeds is not None else [seed + i for i in range(len(rows))]
            try:
                with self._drawing():
                    weight = self._half_head.weight(head) if self._bf16 else head.weight
                    return decoding.draw(body, weight, rows, max_new_tokens, temperature, top_p, own,
                                         self._drawer.end_ids, pad)
            except (TypeError, ValueError, NotImplementedError, AttributeError) as exc:
                # An architecture whose forward takes positions or a cache another way: generate draws.
                log.warning("%s cannot draw with rlfleet's decoding (%s: %s); transformers' generate draws "
                            "(one random stream per batch)", self.ref.spec, type(exc).__name__, exc)
                self._decodes = False
        ids, mask = left_padded(rows, pad, self.device)
        width = ids.shape[1]
        # generate runs without autocast: the fp32 weights, whatever the session trains in.
        with seeded_rng(seed, self.device), self.full_precision():
            out = self._active().generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad,
                **sampling(temperature, top_p),
            )
        return [row[: row.index(eos)] if eos in row else row for row in out[:, width:].tolist()]


class FrozenWeights:
    """The frozen weights of a session's adapted linear layers, each in fp32 (the base's own) and a
    bf16 copy, and which of the two the layers hold. The copy is made once per session; switching is
    a pointer swap. Only outside a pass that autograd will go back through (the backward reads the
    weights the forward saw)."""

    def __init__(self, pairs: Sequence[tuple[Tensor, Tensor, Tensor]] = ()) -> None:
        self._pairs = list(pairs)

    @classmethod
    def of(cls, layers: Sequence[Any], budget: int, fold: bool = False) -> FrozenWeights:
        """Those of ``layers`` (peft tuner layers, or plain linear ones) whose base layer is a plain fp32
        linear one; none when their bf16 copies would take more than ``budget`` bytes (a large model on
        a machine without the memory to spare trains as before, autocast casting each pass). ``fold``:
        each copy with its layer's active LoRA added (:func:`_foldable` layers only)."""
        pairs = []
        for layer in layers:
            base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
            if isinstance(base, torch.nn.Linear) and base.weight.dtype == torch.float32:
                pairs.append((base.weight, layer))
        if sum(2 * w.numel() for w, _ in pairs) > budget:
            return cls()
        return cls([(w, w.data, (w.data + _lora_delta(layer) if fold else w.data).to(torch.bfloat16))
                    for w, layer in pairs])

    def hold(self, half: bool) -> None:
        for param, full, bf16 in self._pairs:
            param.data = bf16 if half else full

    def __len__(self) -> int:
        return len(self._pairs)


def spare_memory() -> int:
    """Bytes of memory the machine can still give (Linux: MemAvailable; 0 where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_only(model: Any, device: str) -> Any:
    """``model`` with no parameter to train, attending as the trainer's passes do (grouped_attention.py)."""
    for p in model.parameters():
        p.requires_grad_(False)
    grouped_attention.use_on(model, device)
    return model


def _plain_head(lm: Any) -> torch.nn.Linear | None:
    """``lm``'s output head where it is a plain linear layer whose logits nothing rescales after it: the
    head can then run on the answer's positions only. None where only the model's full logits are right."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    config = getattr(lm, "config", None)
    if not isinstance(head, torch.nn.Linear) or any(
            getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_POSTPROCESSING):
        return None
    return head


def _head_logits(head: torch.nn.Linear, states: Tensor, half: HalfHead | None = None) -> Tensor:
    """``head``'s fp32 logits over ``states``, whatever autocast the caller is in: every log-prob,
    ratio and KL a run reads comes from them. With ``half`` (a bf16 session's) the product runs on
    the bf16 head and its bf16 result is widened; else in the head's own precision. Either way every
    pass of a session gets the same logits for the same row, so its ratios and KLs compare like with
    like."""
    with torch.autocast(states.device.type, enabled=False):
        if half is None:
            return head(states.to(head.weight.dtype)).float()
        weight = half.weight(head)
        bias = None if head.bias is None else head.bias.to(weight.dtype)
        return torch.nn.functional.linear(states.to(weight.dtype), weight, bias).float()


class HalfHead:
    """A frozen output head's weight in bf16, made once: the head's product over the vocabulary is the
    largest single product of a step, and a bf16 product runs at two to three times the fp32 rate where
    bf16 is native (bench/RESULTS.md, the tenth session). One head is kept: another model's (a
    hindsight teacher's) takes its place while it is read; a head that trains is cast at each use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._source: Tensor | None = None
        self._half: Tensor | None = None

    def weight(self, head: torch.nn.Linear) -> Tensor:
        w = head.weight
        if w.requires_grad:
            return w.to(torch.bfloat16)
        with self._lock:
            if self._source is not w or self._half is None:
                self._source, self._half = w, w.detach().to(torch.bfloat16)
            return self._half


def _lm_and_body(model: Any) -> tuple[Any, Any]:
    """``model``'s language model (inside a peft wrapper, the model it wraps) and its transformer without
    the output head (None where the architecture names none)."""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return lm, getattr(lm, getattr(lm, "base_model_prefix", ""), None)


def _decoder(model: Any) -> tuple[Any, torch.nn.Linear] | None:
    """``model``'s decoder stack and plain output head, for :func:`.decoding.draw`; None where its logits
    are more than the head's product (then transformers' ``generate`` draws)."""
    lm, body = _lm_and_body(model)
    head = _plain_head(lm)
    if body is None or head is None or not hasattr(body, "config"):
        return None
    return body, head


def _foldable(layers: Sequence[Any]) -> bool:
    """Whether every one of ``layers`` (peft tuner layers) adds a plain LoRA product to its frozen one
    (enabled, not merged, no variant such as DoRA): its effect is then a weight to add
    (:func:`_lora_delta`)."""
    return bool(layers) and all(
        not layer.disable_adapters and not layer.merged and hasattr(layer, "get_delta_weight")
        and hasattr(layer, "_disable_adapters")  # the switch _adapters_off flips (peft's own attribute)
        and not any(name in getattr(layer, "lora_variant", {}) for name in layer.active_adapters)
        for layer in layers)


def _lora_delta(layer: Any) -> Tensor:
    """What ``layer``'s active LoRA adapters add to its frozen weight (``scale · B·A``), fp32."""
    return sum((layer.get_delta_weight(name).float() for name in layer.active_adapters if name in layer.lora_A),
               torch.zeros((), device=layer.get_base_layer().weight.device))


@contextlib.contextmanager
def _adapters_off(layers: Sequence[Any]) -> Iterator[None]:
    """``layers`` (peft tuner layers) pass their input to their frozen layer alone for the block (their
    adapters folded into its weights); their adapters' trainability is left as it is (peft's own
    switch turns it off)."""
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _frozen_linears(model: Any) -> list[torch.nn.Linear]:
    """The plain linear layers of ``model`` outside a session, its output head left out (it is tied to
    the input embedding in many models, whose lookups must stay in the weights' own type)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]


def _marked_only(batch: dict[str, Tensor], marked: Tensor) -> dict[str, Tensor]:
    """``batch`` cut after its last ``marked`` position, with the marked positions as its response:
    a pass over it computes the head at those positions only and nothing past the last of them."""
    width = int(marked.any(dim=0).nonzero().max()) + 1
    cut = {k: v[:, :width] for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    return {**batch, **cut, "response_mask": marked[:, :width]}


def _rows_of_positions(batch: dict[str, Tensor]) -> Tensor:
    """The row of each predicted response position, in the row-major order the response logits have."""
    return batch["response_mask"][:, 1:].nonzero()[:, 0].cpu()


def _per_row(batch: dict[str, Tensor], values: Tensor) -> list[float]:
    """``[N]`` values at the response positions summed per row of ``batch`` (fp64)."""
    n_rows = batch["input_ids"].shape[0]
    return torch.zeros(n_rows, dtype=torch.float64).index_add_(
        0, _rows_of_positions(batch), values.double().cpu()).tolist()


def _forward(model: Any, ids: Tensor, attn: Tensor, prefix: int) -> Any:
    """``model``'s output over positions ``prefix`` onwards of every row. The first ``prefix`` tokens,
    the same in every row, run once and their keys and values are shared by the rows: the prompt a
    batch has in common (a system prompt, an environment's instructions) costs one row, not one per
    sample. Gradients flow through the shared keys and values as through a full pass."""
    if prefix == 0:
        return model(input_ids=ids, attention_mask=attn, use_cache=False)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    arg = cache_argument(model)
    model(input_ids=ids[:1, :prefix], use_cache=True, **{arg: cache})
    cache.batch_repeat_interleave(ids.shape[0])
    return model(input_ids=ids[:, prefix:], attention_mask=attn, use_cache=True, **{arg: cache})
