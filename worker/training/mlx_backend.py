"""The MLX backend (Apple Silicon; also runs on Linux CPU): :class:`MlxTrainer`, same runs, same adapters.

It trains the same objective as the torch backend with mlx / mlx_lm instead of torch / peft, and
saves plain peft adapters (:mod:`.mlx_model`).

- LoRA: mlx_lm's ``LoRALinear`` on every linear projection except the output head (peft's
  ``all-linear``), scale = alpha / rank as in peft. mlx keeps ``lora_a`` as ``(in, r)`` and
  ``lora_b`` as ``(r, out)``, the transpose of peft's: saving and loading transpose. Module paths
  are mlx_lm's, which equal the Hugging Face ones for the usual architectures; this is checked
  against the checkpoint's tensor names and shapes at load, so a mismatch fails before training,
  not in the responder.
- Reference log-probs: the same modules with the LoRA scale set to 0 (the base, exactly).
- Weights are cast to float32 by default, as the torch backend loads them: recorded behaviour
  log-probs are fp32 values, and a bf16 policy would move every sequence ratio before any update.

Not thread-safe: a run swaps the model's modules in place and swaps them back afterwards.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

from rlfleet.shared.chat_prompt import prompt_ids
from rlfleet.shared.errors import ConfigError, ModelUnavailable
from rlfleet.shared.models import ModelRef, load_tokenizer

from ..batching import Encoded, collate, micro_batches
from ..presets import TrainConfig
from . import mlx_decoding
from .backend import RefExtras, RowScores, StepStats, TokenSums, TopRow
from .interface import TrainerInterface
from .mlx_model import (
    LoraSpec,
    checkpoint_shapes,
    end_ids,
    fresh_spec,
    hf_folder,
    legacy_rope_fields,
    peft_key,
    read_adapter,
    require_mlx,
    write_adapter,
)
from .teachers import TeacherCache


class MlxTrainer(TrainerInterface):
    def __init__(
        self,
        ref: ModelRef,
        device: str = "mlx",
        cache_dir: Path | None = None,
        dtype: str | None = "float32",
    ) -> None:
        require_mlx()
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        self.ref = ref
        self.device = device
        self._loras: dict[str, Any] = {}  # module path -> LoRALinear while an adapter is applied
        self._spec: LoraSpec | None = None
        self._train: Any = None  # value_and_grad of the objective while training
        self._train_unlikelihood: Any = None  # and of the unlikelihood term on the policy's loops
        self._opt: Any = None
        self._grads: Any = None
        self._grad_clip = 0.0
        self._cache_dir, self._dtype = cache_dir, dtype
        self.tokenizer = load_tokenizer(ref)
        self._teachers = TeacherCache(self.tokenizer)
        self.folder = hf_folder(ref, cache_dir)
        self.config, self.model = self._load(ref, self.folder)
        self._end_ids = end_ids(self.folder, self.config, self.tokenizer)
        # a list of (path, array) pairs: mlx annotates the return as that or a dict, which it returns
        # only when given a dict to fill
        flat = cast("list[tuple[str, Any]]", tree_flatten(self.model.parameters()))
        self._n_params = sum(v.size for _, v in flat)
        self._targets = self._lora_targets(nn)

    def _load(self, ref: ModelRef, folder: Path) -> tuple[dict, Any]:
        """A model's config and its mlx_lm model in this trainer's dtype, frozen (never trained)."""
        mx = _mx()
        from mlx_lm.utils import load_model as mlx_load_model

        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        try:
            loaded = mlx_load_model(folder, model_config=legacy_rope_fields(config))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelUnavailable(f"mlx_lm cannot load {ref.spec} from {folder}: {exc}") from None
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if self._dtype is not None:
            model.set_dtype(getattr(mx, self._dtype))
        model.freeze()  # the base is never trained; only LoRA weights are
        model.eval()
        mx.eval(model.parameters())
        return config, model

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def is_moe(self) -> bool:
        cfg = self.config.get("text_config") or self.config
        return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))

    def _modules(self) -> dict[str, Any]:
        return dict(self.model.named_modules())

    def _lora_targets(self, nn: Any) -> list[str]:
        """peft's ``all-linear``: every linear layer but the output head, checked against the HF
        checkpoint so that the saved key names and shapes are the ones peft will look for."""
        hf = checkpoint_shapes(self.folder)
        targets, unmapped = [], []
        for name, m in self._modules().items():
            if not isinstance(m, nn.Linear | nn.QuantizedLinear) or name.rsplit(".", 1)[-1] == "lm_head":
                continue
            out_dims, in_dims = m.weight.shape
            if isinstance(m, nn.QuantizedLinear):
                in_dims = in_dims * 32 // m.bits
            if hf.get(f"{name}.weight") == (out_dims, in_dims):
                targets.append(name)
            else:
                unmapped.append(name)
        if not targets or unmapped:
            raise ModelUnavailable(
                f"mlx_lm's layers of {self.ref.spec} do not map onto its Hugging Face names "
                f"(e.g. {(unmapped or ['none found'])[:2]}); train it with train.device = 'auto'"
            )
        return sorted(targets)

    # -- model state ------------------------------------------------------------------------------

    def seed(self, seed: int) -> None:
        _mx().random.seed(seed)

    @contextlib.contextmanager
    def adapter(
        self, adapter_dir: Path | None, cfg: TrainConfig | None, trainable: bool = False, precision: str = "fp32"
    ) -> Iterator[LoraSpec]:
        """The model with LoRA layers for the block; the original modules are put back afterwards.

        With ``adapter_dir`` the adapter's own config (rank, alpha, modules) and weights are loaded;
        otherwise a fresh LoRA from ``cfg`` (B = 0, so it starts equal to the base). MLX computes in
        the weights' dtype: ``trainable`` and ``precision`` change nothing here.
        """
        import mlx.core as mx
        from mlx.utils import tree_unflatten
        from mlx_lm.tuner.lora import LoRALinear

        if adapter_dir is not None:
            spec = read_adapter(Path(adapter_dir), self._targets, self.ref.spec)
        elif cfg is not None:
            spec = fresh_spec(cfg.rank, cfg.alpha, self._targets)
        else:
            raise ValueError("a fresh adapter needs a TrainConfig")
        modules = self._modules()
        originals = [(p, modules[p]) for p in spec.paths]
        loras = {p: LoRALinear.from_base(m, r=spec.rank, dropout=0.0, scale=spec.scale) for p, m in originals}
        self.model.update_modules(tree_unflatten(list(loras.items())))
        try:
            for p, lora in loras.items():
                if spec.weights is not None:
                    a, b = spec.weights[peft_key(p, "A")], spec.weights[peft_key(p, "B")]
                    if a.shape != (spec.rank, lora.lora_a.shape[0]) or b.shape != (lora.lora_b.shape[1], spec.rank):
                        raise ValueError(f"adapter {adapter_dir}: {p} has shapes {a.shape}, {b.shape}")
                    lora.lora_a = mx.array(a.T).astype(mx.float32)
                    lora.lora_b = mx.array(b.T).astype(mx.float32)
                else:
                    lora.lora_a = lora.lora_a.astype(mx.float32)
            mx.eval(self.model.trainable_parameters())
            self._loras, self._spec = loras, spec
            yield spec
        finally:
            self._loras, self._spec, self._train, self._opt, self._grads = {}, None, None, None, None
            self.model.update_modules(tree_unflatten(originals))
            self.model.eval()

    @property
    def precision(self) -> str:
        """The weights' dtype decides (fp32 by default); a session never lowers it."""
        return "bf16" if self._dtype == "bfloat16" else "fp32"

    @property
    def step_stands_in(self) -> bool:
        return False  # its step is one value_and_grad function that takes the fixed log-probs

    @property
    def rows_seeded(self) -> bool:
        return True  # each row from its own stream (mlx_decoding)

    def full_precision(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """LoRA scale 0: the forward pass is the base's, exactly (``y + 0 * z``)."""
        scales = {p: lora.scale for p, lora in self._loras.items()}
        for lora in self._loras.values():
            lora.scale = 0.0
        try:
            yield
        finally:
            for p, lora in self._loras.items():
                lora.scale = scales[p]

    @contextlib.contextmanager
    def teacher(self, spec: str | None) -> Iterator[None]:
        if spec is None:
            with self.reference():
                yield
            return
        model = self._teachers.get(spec, lambda ref: self._load(ref, hf_folder(ref, self._cache_dir))[1])
        policy, self.model = self.model, model  # the forward passes read self.model
        try:
            yield
        finally:
            self.model = policy

    def save(self, out_dir: Path) -> None:
        """``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r) per module, in a peft folder."""
        import numpy as np

        if self._spec is None:
            raise RuntimeError("no adapter is applied")
        f32 = _mx().float32
        tensors: dict[str, Any] = {}
        for p, lora in sorted(self._loras.items()):
            tensors[peft_key(p, "A")] = np.ascontiguousarray(np.array(lora.lora_a.astype(f32)).T)
            tensors[peft_key(p, "B")] = np.ascontiguousarray(np.array(lora.lora_b.astype(f32)).T)
        write_adapter(out_dir, self._spec, tensors, self.ref.path)

    # -- tensors ----------------------------------------------------------------------------------

    def batches(self, encoded: Sequence[Encoded], budget: int) -> tuple[list[list[int]], list[dict]]:
        mx = _mx()
        groups = micro_batches(encoded, budget)
        batches = []
        for g in groups:
            t = collate([encoded[i] for i in g], self.tokenizer.pad_token_id)
            resp = t["response_mask"].numpy()
            if resp[:, 0].any():
                raise ValueError("a response token at position 0 has no context to be predicted from")
            ids = mx.array(t["input_ids"].numpy().astype("int32"))
            batches.append({"input_ids": ids, "response_mask": mx.array(resp)})
        return groups, batches

    def vector(self, values: Sequence[float]) -> Any:
        mx = _mx()
        return mx.array(list(values), dtype=mx.float32)

    def _logits(self, ids: Any) -> tuple[Any, Any]:
        """``[B, L-1, V]`` fp32 next-token logits at every position but the last, and their logsumexp
        (``[B, L-1, 1]``).

        Batches are right-padded: with causal attention the padding never reaches a real position,
        so no attention mask is needed."""
        mx = _mx()
        logits = self.model(ids)[:, :-1].astype(mx.float32)
        return logits, mx.logsumexp(logits, axis=-1, keepdims=True)

    def _at_positions(self, values: Any, mask: Any) -> Any:
        """``[B, L-1]`` per-prediction values as ``[B, L]`` per-token ones (token t is predicted at
        t-1), 0 off the response mask."""
        mx = _mx()
        out = mx.concatenate([mx.zeros((values.shape[0], 1), dtype=mx.float32), values], axis=1)
        return mx.where(mask, out, mx.zeros_like(out))

    def _logits_and_logprobs(self, ids: Any, mask: Any) -> tuple[Any, Any, Any]:
        """:meth:`_logits`, and the ``[B, L]`` fp32 log-prob of each response token given its prefix
        (0 off the response mask)."""
        mx = _mx()
        logits, lse = self._logits(ids)
        target = mx.take_along_axis(logits, ids[:, 1:, None], axis=-1)
        return logits, lse, self._at_positions((target - lse).squeeze(-1), mask)

    def _logprobs(self, ids: Any, mask: Any) -> Any:
        """``[B, L]`` fp32 log-prob of each response token given its prefix; 0 off the response mask."""
        return self._logits_and_logprobs(ids, mask)[2]

    def reference_logprobs(self, batch: dict, top_k: int = 0, entropy: bool = False) -> tuple[Any, RefExtras]:
        from ..objective_mlx import next_token_entropy

        mx = _mx()
        logits, lse, lp = self._logits_and_logprobs(batch["input_ids"], batch["response_mask"])
        top = ent = None
        if top_k:
            k = min(top_k, logits.shape[-1])
            top_ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
            top = (top_ids, mx.take_along_axis(logits, top_ids, axis=-1) - lse)
        if entropy:
            ent = next_token_entropy(logits, lse)  # [B, L-1]: every prediction, read at the answer's
        mx.eval(lp, *(top or ()), *(() if ent is None else (ent,)))
        return lp, RefExtras(top=top, entropy=ent)

    def response_top(self, batch: dict, top_k: int) -> list[TopRow]:
        import numpy as np

        mx = _mx()
        ids = batch["input_ids"]
        logits, lse = self._logits(ids)
        k = min(top_k, logits.shape[-1])
        top_ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        top_lp = mx.take_along_axis(logits, top_ids, axis=-1) - lse
        token = (mx.take_along_axis(logits, ids[:, 1:, None], axis=-1) - lse).squeeze(-1)
        mx.eval(top_ids, top_lp, token)
        pred = np.array(batch["response_mask"])[:, 1:]  # token t is predicted at t-1
        i_np, lp_np, t_np = np.array(top_ids), np.array(top_lp), np.array(token)
        return [TopRow(i_np[r][pred[r]], lp_np[r][pred[r]], t_np[r][pred[r]]) for r in range(pred.shape[0])]

    def teacher_targets(self, batch: dict, rows: Sequence[tuple[TopRow, float] | None]) -> tuple[Any, Any, Any]:
        """``[B, L-1, K]`` ids and log-probs and ``[B, L-1]`` weights at every prediction position (the
        layout of :meth:`_logits`); off a taught answer's positions, filler of weight 0."""
        import numpy as np

        mx = _mx()
        pred = np.array(batch["response_mask"])[:, 1:]
        k = next(r[0].ids.shape[1] for r in rows if r is not None)
        ids = np.zeros((*pred.shape, k), dtype=np.int32)
        lps = np.full((*pred.shape, k), -30.0, dtype=np.float32)  # finite: 0 * KL stays 0
        weights = np.zeros(pred.shape, dtype=np.float32)
        for r, row in enumerate(rows):
            if row is None:
                continue
            top, weight = row
            if top.ids.shape[0] != int(pred[r].sum()):
                raise ValueError(f"a teacher row has {top.ids.shape[0]} positions, its answer {int(pred[r].sum())}")
            ids[r][pred[r]], lps[r][pred[r]], weights[r][pred[r]] = top.ids, top.logprobs, weight
        return mx.array(ids), mx.array(lps), mx.array(weights)

    def teacher_divergence(self, batch: dict, targets: tuple[Any, Any, Any]) -> list[tuple[float, int]]:
        import numpy as np

        from ..objective_mlx import hindsight_kl

        mx = _mx()
        logits, lse = self._logits(batch["input_ids"])
        t_ids, t_lp, weights = targets  # [B, L-1, K], [B, L-1, K], [B, L-1]
        kl = hindsight_kl(mx.take_along_axis(logits, t_ids, axis=-1) - lse, t_lp) * weights
        sums, counts = kl.sum(axis=-1), (weights > 0).astype(mx.float32).sum(axis=-1)
        mx.eval(sums, counts)
        return [(float(v), int(n)) for v, n in zip(np.array(sums).tolist(), np.array(counts).tolist(), strict=True)]

    def logprobs(self, batch: dict) -> Any:
        lp = self._logprobs(batch["input_ids"], batch["response_mask"])
        _mx().eval(lp)
        return lp

    def with_recorded(
        self, logprobs: Any, rows: Sequence[tuple[int, int, Sequence[float]]], shift: Any = None
    ) -> Any:
        import numpy as np

        arr = np.array(logprobs, dtype=np.float32)
        moved = None if shift is None else np.array(shift, dtype=np.float32)
        for row, start, values in rows:
            end = start + len(values)
            arr[row, start:end] = np.asarray(values, dtype=np.float32)
            if moved is not None:
                arr[row, start:end] += moved[row, start:end]
        return _mx().array(arr)

    def kl_sum(self, batch: dict, ref: Any) -> tuple[float, float]:
        from ..objective_mlx import k3_kl

        mx = _mx()
        mask = batch["response_mask"]
        new = self._logprobs(batch["input_ids"], mask)
        kl = mx.where(mask, k3_kl(new, ref), mx.zeros_like(new)).sum()
        return float(kl), float(mask.sum())

    # -- optimizer --------------------------------------------------------------------------------

    def begin_training(self, cfg: TrainConfig) -> None:
        import mlx.nn as nn
        import mlx.optimizers as optim

        from ..objective_mlx import (
            entropy_excess,
            hindsight_kl,
            mispo_loss,
            next_token_entropy,
            per_answer_mean,
            top_k_kl,
            unlikelihood,
        )

        mx = _mx()
        objective = getattr(cfg, "objective", "mispo")
        if objective != "mispo":
            raise ConfigError(
                f"the mlx trainer implements only the 'mispo' objective, not {objective!r}; "
                "use train.device = 'auto' for it"
            )

        def loss_fn(ids, mask, beh, ref, advantages, share, ref_top, ref_entropy, teacher):
            logits, lse, logp = self._logits_and_logprobs(ids, mask)
            anchor = None
            if ref_top is not None:
                top_ids, top_ref = ref_top
                anchor = self._at_positions(top_k_kl(mx.take_along_axis(logits, top_ids, axis=-1) - lse, top_ref), mask)
            out = mispo_loss(
                logp, beh, ref, mask, advantages,
                token_band=cfg.token_band, seq_band=cfg.seq_band, beta=cfg.beta, anchor=anchor,
                neg_fade=cfg.neg_fade,
            )  # fmt: skip
            loss, stats = out.loss, {"loss": out.loss, **out.stats()}
            if ref_entropy is not None:
                # The mean over the response positions, as the torch backend's rows are.
                at = self._at_positions(entropy_excess(next_token_entropy(logits, lse), ref_entropy), mask)
                excess = at.sum() / mx.maximum(mask.astype(mx.float32).sum(), 1.0)
                loss = loss + cfg.entropy_hinge * excess
                stats["entropy_excess"] = mx.stop_gradient(excess)
            if teacher is not None:
                t_ids, t_lp, weights = teacher
                student = mx.take_along_axis(logits, t_ids, axis=-1) - lse
                distill = per_answer_mean(hindsight_kl(student, t_lp), weights, ids.shape[0])
                loss = loss + cfg.hindsight * distill
                stats["hindsight_kl"] = mx.stop_gradient(distill)
            return loss * share, stats

        self._train = nn.value_and_grad(self.model, loss_fn)

        def unlikelihood_fn(ids, mask, marks, scale):
            value = unlikelihood(self._logprobs(ids, mask), mask, marks)
            return value * scale, value

        self._train_unlikelihood = nn.value_and_grad(self.model, unlikelihood_fn)
        self._opt = optim.AdamW(learning_rate=cfg.lr, bias_correction=True)  # torch.optim.AdamW's defaults
        self._grad_clip = cfg.grad_clip

    def begin_step(self) -> None:
        self._grads = None

    def accumulate(
        self, batch: dict, beh: Any, ref: Any, advantages: Any, share: float, extras: RefExtras | None = None
    ) -> StepStats:
        from mlx.utils import tree_map

        mx = _mx()
        ref_top = None if extras is None else extras.top
        ref_entropy = None if extras is None else extras.entropy
        teacher = None if extras is None else extras.teacher
        (_, stats), g = self._train(batch["input_ids"], batch["response_mask"], beh, ref, advantages, share, ref_top,
                                    ref_entropy, teacher)
        self._grads = g if self._grads is None else tree_map(mx.add, self._grads, g)
        mx.eval(self._grads, stats)
        return StepStats(
            loss=float(stats["loss"]),
            mean_kl=float(stats["mean_kl"]),
            n_tokens=float(stats["n_tokens"]),
            accepted_tokens=float(stats["accepted_tokens"]),
            accepted_seqs=float(stats["accepted_seqs"]),
            anchor_kl=float(stats["anchor_kl"]) if ref_top is not None else None,
            entropy_excess=float(stats["entropy_excess"]) if ref_entropy is not None else None,
            hindsight_kl=float(stats["hindsight_kl"]) if teacher is not None else None,
        )

    def accumulate_unlikelihood(
        self, batch: dict, marks: Sequence[tuple[int, int, Sequence[int]]], weight: float, share: float
    ) -> float:
        import numpy as np
        from mlx.utils import tree_map

        mx = _mx()
        hit = np.zeros(batch["response_mask"].shape, dtype=bool)
        for row, start, positions in marks:
            hit[row, [start + t for t in positions]] = True
        (_, value), g = self._train_unlikelihood(batch["input_ids"], batch["response_mask"], mx.array(hit),
                                                 weight * share)
        self._grads = g if self._grads is None else tree_map(mx.add, self._grads, g)
        mx.eval(self._grads, value)
        return float(value)

    def finish_step(self, apply: bool) -> None:
        import mlx.optimizers as optim

        grads, _norm = optim.clip_grad_norm(self._grads, self._grad_clip)
        if apply:
            self._opt.update(self.model, grads)
            _mx().eval(self.model.trainable_parameters(), self._opt.state)

    # -- measurements -----------------------------------------------------------------------------

    def response_logprobs(self, batch: dict) -> list[list[float]]:
        import numpy as np

        lp = np.array(self._logprobs(batch["input_ids"], batch["response_mask"]))
        mask = np.array(batch["response_mask"])
        return [lp[row][mask[row]].tolist() for row in range(lp.shape[0])]

    def pooled_hidden(self, batch: dict) -> list[list[float]]:
        """mlx_lm's models keep the transformer without its output head as ``.model``; its output is
        the normed last hidden layer, as Hugging Face's ``last_hidden_state`` is."""
        import numpy as np

        mx = _mx()
        body = getattr(self.model, "model", None)
        if body is None:
            raise NotImplementedError(f"mlx_lm's {type(self.model).__name__} has no .model to read hidden states from")
        hidden = body(batch["input_ids"]).astype(mx.float32)
        mask = batch["response_mask"][..., None].astype(mx.float32)
        pooled = (hidden * mask).sum(axis=1) / mx.maximum(mask.sum(axis=1), 1.0)
        return cast("list[list[float]]", np.array(pooled).tolist())

    def pooled_endings(self, batch: dict, endings: Sequence[Sequence[int]]
                       ) -> tuple[list[list[float]], list[list[list[float]]]]:
        raise NotImplementedError("the MLX trainer encodes each earlier ending as a row of its own")

    def score_rows(self, batch: dict, with_kl: bool) -> list[RowScores]:
        import numpy as np

        mx = _mx()
        ids = batch["input_ids"]
        pred = np.array(batch["response_mask"])[:, 1:]

        def sums(logp: Any, kl: Any) -> list[TokenSums]:
            ent = -(mx.exp(logp) * logp).sum(axis=-1)
            tok = mx.take_along_axis(logp, ids[:, 1:, None], axis=-1).squeeze(-1)
            tok_np, ent_np, kl_np = (np.array(a) for a in (tok, ent, mx.zeros_like(ent) if kl is None else kl))
            return [
                TokenSums(float(t[m].sum()), float(e[m].sum()), float(k[m].sum()), int(m.sum()))
                for t, e, k, m in zip(tok_np, ent_np, kl_np, pred, strict=True)
            ]

        logp = self._log_softmax(ids)
        if not with_kl:
            return [RowScores(row) for row in sums(logp, None)]
        with self.reference():
            ref = self._log_softmax(ids)
        model = sums(logp, (mx.exp(logp) * (logp - ref)).sum(axis=-1))
        return [RowScores(m, b) for m, b in zip(model, sums(ref, None), strict=True)]

    def _log_softmax(self, ids: Any) -> Any:
        """``[B, L-1, V]`` fp32 next-token log-probs at every position but the last."""
        logits, lse = self._logits(ids)
        return logits - lse

    def sample(
        self, prompts: Sequence[list[dict]], max_new_tokens: int, seed: int,
        temperature: float = 0.7, top_p: float = 1.0, seeds: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """The prompts' answers drawn in one batch (:func:`.mlx_decoding.draw`), each row from a stream
        of its own (``seeds``, or ``seed + i``): the torch trainer's rules, so the same seed draws the
        same answer from the same weights on either backend."""
        rows = [prompt_ids(self.tokenizer, p) for p in prompts]
        own = list(seeds) if seeds is not None else [seed + i for i in range(len(rows))]
        if len(own) != len(rows):
            raise ValueError(f"{len(rows)} prompts but {len(own)} seeds")
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        return mlx_decoding.draw(self.model, rows, max_new_tokens, temperature, top_p, own, self._end_ids, pad)


def _mx() -> Any:
    import mlx.core as mx

    return mx
