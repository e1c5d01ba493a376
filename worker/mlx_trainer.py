"""The MLX training backend (Apple Silicon; also runs on Linux CPU): same runs, same adapters.

:class:`MlxTrainer` has the interface of :class:`rlfleet.worker.trainer.Trainer` and trains the same
objective (DESIGN.md §6) with mlx / mlx_lm instead of torch / peft. What it saves is a plain peft
adapter (``adapter_config.json`` + ``adapter_model.safetensors`` with peft's key names and shapes),
so the registry keeps one format: an MLX-trained version is served by the torch responder, exported,
and continued by either backend.

- The model is loaded with ``mlx_lm.utils.load_model`` from a Hugging Face folder. A GGUF model (the
  default model is one) or a folder without safetensors is first converted once, with transformers,
  into a cache folder (``~/.cache/rlfleet/hf/<slug>-<hash>``), written to a temporary folder and
  renamed into place.
- LoRA: mlx_lm's ``LoRALinear`` on every linear projection except the output head (peft's
  ``all-linear``), scale = alpha / rank as in peft. mlx keeps ``lora_a`` as ``(in, r)`` and
  ``lora_b`` as ``(r, out)``; peft's ``lora_A.weight`` is ``(r, in)`` and ``lora_B.weight``
  ``(out, r)``: saving and loading transpose. Module paths are mlx_lm's, which equal the Hugging
  Face ones for the usual architectures; this is checked against the checkpoint's tensor names and
  shapes at load, so a mismatch fails before training, not in the responder.
- Reference log-probs: the same modules with the LoRA scale set to 0 (the base, exactly).
- Weights are cast to float32 by default, as the torch trainer loads them: recorded behaviour
  log-probs are fp32 values, and a bf16 policy would move every sequence ratio before any update.

Not thread-safe: a run swaps the model's modules in place and swaps them back afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.shared.errors import ConfigError, ModelUnavailable
from rlfleet.shared.models import ModelRef, load_tokenizer

from .batching import Encoded, collate, encode_sample, micro_batches
from .objective import run_check
from .presets import TrainConfig
from .samples import Progress, RunResult, TrainSample
from .training.advantages import run_advantages

INSTALL_HINT = "pip install -e '.[mlx]'"
_PEFT_PREFIX = "base_model.model."


def require_mlx() -> None:
    """Raise :class:`ModelUnavailable` with the install command when mlx or mlx_lm is missing."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        raise ModelUnavailable(
            f"train.device = 'mlx' needs mlx and mlx-lm ({exc}); run: {INSTALL_HINT}"
        ) from None


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "rlfleet" / "hf"


def _has_safetensors(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def hf_folder(ref: ModelRef, cache_dir: Path | None = None) -> Path:
    """A Hugging Face folder with safetensors weights that mlx_lm can load for ``ref``.

    A local folder that already is one is used as is; a hub id already in the Hugging Face cache
    is used from there; anything else (a GGUF file, ``.bin`` weights, a hub id not cached) is
    loaded once with transformers in fp32 and saved into ``cache_dir`` (atomically: a temporary
    folder renamed into place, so a crash or a concurrent conversion never leaves half a model).
    """
    if ref.gguf_file is None:
        local = Path(ref.path)
        if local.is_dir():
            if _has_safetensors(local):
                return local
        else:
            with contextlib.suppress(Exception):
                from huggingface_hub import snapshot_download

                cached = Path(snapshot_download(ref.path, local_files_only=True))
                if _has_safetensors(cached):
                    return cached
    key = str(Path(ref.path) / (ref.gguf_file or ""))
    source = Path(key)
    if source.is_file():  # a changed file under the same name gets a new conversion
        st = source.stat()
        key += f":{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    dest = Path(cache_dir or cache_root()) / f"{ref.slug}-{digest}"
    if _has_safetensors(dest):
        return dest
    return _convert(ref, dest)


def _convert(ref: ModelRef, dest: Path) -> Path:
    from rlfleet.shared.models import load_model

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        model = load_model(ref, "cpu")  # fp32, GGUF dequantised: what the torch trainer trains on
        if ref.gguf_file:
            # The weights are plain fp32 tensors by now, but transformers still marks the model as
            # GGUF-quantised and refuses to save it; the mark (and its config entry) is all there is.
            model.hf_quantizer = None
            for holder in (model, model.config):
                if hasattr(holder, "quantization_config"):
                    delattr(holder, "quantization_config")
            model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(str(tmp))
        del model
        load_tokenizer(ref).save_pretrained(str(tmp))
        try:
            os.rename(tmp, dest)
        except OSError:
            if not _has_safetensors(dest):  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the Hugging Face checkpoint in ``folder`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        with safe_open(str(f), framework="numpy") as fh:
            for k in fh.keys():
                shapes[k] = tuple(fh.get_slice(k).get_shape())
    return shapes


def legacy_rope_fields(config: dict) -> dict:
    """``rope_theta`` / ``rope_scaling`` from transformers 5's ``rope_parameters``, for mlx_lm.

    transformers 5 saves a model's RoPE settings as ``rope_parameters`` (its GGUF conversion of the
    default model too); many mlx_lm architectures (llama among them) still read only the older
    top-level fields and would silently fall back to ``rope_theta = 10000``. Only the flat form is
    translated (per-layer-type parameters are left to the architectures that read them)."""
    rope = config.get("rope_parameters")
    if "rope_theta" in config or not isinstance(rope, dict) or "rope_theta" not in rope:
        return {}
    extra = {k: v for k, v in rope.items() if k != "rope_theta"}
    out: dict[str, Any] = {"rope_theta": rope["rope_theta"]}
    if extra.get("rope_type", extra.get("type", "default")) != "default" and "rope_scaling" not in config:
        out["rope_scaling"] = extra
    return out


@dataclass
class _LoraSpec:
    rank: int
    alpha: float
    paths: list[str]  # module paths, the same in mlx_lm and in the Hugging Face model
    scale: float
    config: dict | None = None  # a parent's adapter_config.json, kept for the child
    weights: dict[str, Any] | None = None  # peft key -> numpy array


class MlxTrainer:
    def __init__(
        self,
        ref: ModelRef,
        device: str = "mlx",
        cache_dir: Path | None = None,
        dtype: str | None = "float32",
    ) -> None:
        require_mlx()
        import mlx.core as mx
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model as mlx_load_model

        self.ref = ref
        self.device = device
        self._loras: dict[str, Any] = {}  # module path -> LoRALinear while an adapter is applied
        self.tokenizer = load_tokenizer(ref)
        self.folder = hf_folder(ref, cache_dir)
        self.config = json.loads((self.folder / "config.json").read_text(encoding="utf-8"))
        try:
            loaded = mlx_load_model(self.folder, model_config=legacy_rope_fields(self.config))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelUnavailable(f"mlx_lm cannot load {ref.spec} from {self.folder}: {exc}") from None
        self.model = loaded[0] if isinstance(loaded, tuple) else loaded
        if dtype is not None:
            self.model.set_dtype(getattr(mx, dtype))
        self.model.freeze()  # the base is never trained; only LoRA weights are
        self.model.eval()
        mx.eval(self.model.parameters())
        self._n_params = sum(v.size for _, v in tree_flatten(self.model.parameters()))
        self._targets = self._lora_targets(nn)

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def is_moe(self) -> bool:
        cfg = self.config.get("text_config") or self.config
        return bool(cfg.get("num_experts") or cfg.get("num_local_experts"))

    # -- LoRA ---------------------------------------------------------------------------------

    def _modules(self) -> dict[str, Any]:
        return dict(self.model.named_modules())

    def _lora_targets(self, nn: Any) -> list[str]:
        """peft's ``all-linear``: every linear layer but the output head, checked against the HF
        checkpoint so that the saved key names and shapes are the ones peft will look for."""
        hf = _checkpoint_shapes(self.folder)
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

    def _spec(self, adapter_dir: Path | None, cfg: TrainConfig | None) -> _LoraSpec:
        if adapter_dir is None:
            if cfg is None:
                raise ValueError("a fresh adapter needs a TrainConfig")
            return _LoraSpec(cfg.rank, cfg.alpha, list(self._targets), cfg.alpha / cfg.rank)
        from safetensors.numpy import load_file

        adapter_dir = Path(adapter_dir)
        config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
        if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
            raise ValueError(f"adapter {adapter_dir} is not a plain LoRA; the mlx trainer cannot continue it")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise ValueError(f"adapter {adapter_dir} has per-module ranks; the mlx trainer cannot continue it")
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
        paths = sorted({k[len(_PEFT_PREFIX) :].rsplit(".lora_", 1)[0] for k in weights if ".lora_" in k})
        known = set(self._targets)
        unexpected = [k for k in weights if not _peft_key_ok(k, known)]
        missing = [f"{p}.lora_{w}" for p in paths for w in "AB" if _peft_key(p, w) not in weights]
        if unexpected or missing or not paths:
            raise ValueError(
                f"adapter {adapter_dir} does not fit {self.ref.spec}: "
                f"unexpected {unexpected[:3]}, missing {missing[:3]}"
            )
        return _LoraSpec(rank, alpha, paths, scale, config=config, weights=weights)

    @contextlib.contextmanager
    def _adapter(self, adapter_dir: Path | None, cfg: TrainConfig | None) -> Iterator[_LoraSpec]:
        """The model with LoRA layers for the block; the original modules are put back afterwards.

        With ``adapter_dir`` the adapter's own config (rank, alpha, modules) and weights are loaded;
        otherwise a fresh LoRA from ``cfg`` (B = 0, so it starts equal to the base).
        """
        import mlx.core as mx
        from mlx.utils import tree_unflatten
        from mlx_lm.tuner.lora import LoRALinear

        spec = self._spec(adapter_dir, cfg)
        modules = self._modules()
        originals = [(p, modules[p]) for p in spec.paths]
        loras = {p: LoRALinear.from_base(m, r=spec.rank, dropout=0.0, scale=spec.scale) for p, m in originals}
        self.model.update_modules(tree_unflatten(list(loras.items())))
        try:
            for p, lora in loras.items():
                if spec.weights is not None:
                    a, b = spec.weights[_peft_key(p, "A")], spec.weights[_peft_key(p, "B")]
                    if a.shape != (spec.rank, lora.lora_a.shape[0]) or b.shape != (lora.lora_b.shape[1], spec.rank):
                        raise ValueError(f"adapter {adapter_dir}: {p} has shapes {a.shape}, {b.shape}")
                    lora.lora_a = mx.array(a.T).astype(mx.float32)
                    lora.lora_b = mx.array(b.T).astype(mx.float32)
                else:
                    lora.lora_a = lora.lora_a.astype(mx.float32)
            mx.eval(self.model.trainable_parameters())
            self._loras = loras
            yield spec
        finally:
            self._loras = {}
            self.model.update_modules(tree_unflatten(originals))
            self.model.eval()

    @contextlib.contextmanager
    def _base_only(self) -> Iterator[None]:
        """LoRA scale 0: the forward pass is the base's, exactly (``y + 0 * z``)."""
        scales = {p: lora.scale for p, lora in self._loras.items()}
        for lora in self._loras.values():
            lora.scale = 0.0
        try:
            yield
        finally:
            for p, lora in self._loras.items():
                lora.scale = scales[p]

    def _save(self, out_dir: Path, spec: _LoraSpec) -> None:
        """Write a peft adapter: ``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r) per module."""
        import numpy as np
        from safetensors.numpy import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, Any] = {}
        for p, lora in sorted(self._loras.items()):
            tensors[_peft_key(p, "A")] = np.ascontiguousarray(np.array(lora.lora_a.astype(_mx().float32)).T)
            tensors[_peft_key(p, "B")] = np.ascontiguousarray(np.array(lora.lora_b.astype(_mx().float32)).T)
        save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
        if spec.config is not None:
            config = dict(spec.config)  # a lineage keeps its shape
        else:
            config = _lora_config(spec.rank, spec.alpha, spec.paths, self.ref.path)
        config["inference_mode"] = True
        (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    # -- log-probs ----------------------------------------------------------------------------

    def _logprobs(self, ids: Any, mask: Any) -> Any:
        """``[B, L]`` fp32 log-prob of each response token given its prefix; 0 off the response mask.

        Batches are right-padded: with causal attention the padding never reaches a real position,
        so no attention mask is needed."""
        mx = _mx()
        logits = self.model(ids)[:, :-1].astype(mx.float32)
        target = mx.take_along_axis(logits, ids[:, 1:, None], axis=-1).squeeze(-1)
        lp = target - mx.logsumexp(logits, axis=-1)
        lp = mx.concatenate([mx.zeros((ids.shape[0], 1), dtype=mx.float32), lp], axis=1)
        return mx.where(mask, lp, mx.zeros_like(lp))

    def _batches(self, encoded: Sequence[Encoded], budget: int) -> tuple[list[list[int]], list[dict]]:
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

    # -- a run --------------------------------------------------------------------------------

    def run(
        self,
        samples: list[TrainSample],
        ema: float | None,
        cfg: TrainConfig,
        parent_adapter: Path | None,
        out_dir: Path,
        progress: Callable[[Progress], None] | None = None,
    ) -> RunResult:
        """Train ``cfg.steps`` optimizer steps over all ``samples``; save the adapter to ``out_dir``."""
        import mlx.core as mx
        import mlx.nn as nn
        import mlx.optimizers as optim
        from mlx.utils import tree_map

        from .objective_mlx import mispo_loss

        if not samples:
            raise ValueError("a training run needs at least one sample")
        objective = getattr(cfg, "objective", "mispo")
        if objective != "mispo":
            raise ConfigError(
                f"the mlx trainer implements only the 'mispo' objective, not {objective!r}; "
                "use train.device = 'auto' for it"
            )
        started = time.perf_counter()
        report = progress or (lambda _p: None)
        out_dir = Path(out_dir)

        encoded = [encode_sample(self.tokenizer, s, cfg.max_tokens) for s in samples]
        groups, batches = self._batches(encoded, cfg.micro_batch_tokens)
        adv_list = self._advantages(samples, ema, cfg)
        adv = mx.array(adv_list, dtype=mx.float32)
        n_samples = len(samples)
        n_response = sum(e.n_response for e in encoded)
        n_seen = sum(e.length for e in encoded)

        mx.random.seed(cfg.seed)  # LoRA A init repeats per seed
        with self._adapter(parent_adapter, cfg) as spec:
            report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0, phase="reference"))
            ref_lp, beh_lp = self._fixed_logprobs(encoded, groups, batches, parent_adapter)
            report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0))  # the optimizer steps begin

            def loss_fn(ids, mask, beh, ref, group_adv, share):
                out = mispo_loss(
                    self._logprobs(ids, mask),
                    beh,
                    ref,
                    mask,
                    group_adv,
                    token_band=cfg.token_band,
                    seq_band=cfg.seq_band,
                    beta=cfg.beta,
                )
                # Each micro-batch's loss is a mean over its sequences: weighting by its share of
                # sequences makes the accumulated gradient the mean over the whole step.
                return out.loss * share, {"loss": out.loss, **out.stats()}

            value_and_grad = nn.value_and_grad(self.model, loss_fn)
            opt = optim.AdamW(learning_rate=cfg.lr, bias_correction=True)  # torch.optim.AdamW's defaults
            token_fracs: list[float] = []
            seq_fracs: list[float] = []
            loss_value = mean_kl = start_kl = float("nan")
            train_started = time.perf_counter()
            for step in range(cfg.steps):
                grads = None
                step_loss = kl_sum = tok_acc = seq_acc = 0.0
                for k, (group, batch) in enumerate(zip(groups, batches, strict=True)):
                    share = len(group) / n_samples
                    (_, stats), g = value_and_grad(
                        batch["input_ids"], batch["response_mask"], beh_lp[k], ref_lp[k],
                        adv[mx.array(group)], share,
                    )  # fmt: skip
                    grads = g if grads is None else tree_map(mx.add, grads, g)
                    mx.eval(grads, stats)
                    n_tok = float(stats["n_tokens"])
                    step_loss += float(stats["loss"]) * share
                    kl_sum += float(stats["mean_kl"]) * n_tok
                    tok_acc += float(stats["accepted_tokens"])
                    seq_acc += float(stats["accepted_seqs"])
                grads, _norm = optim.clip_grad_norm(grads, cfg.grad_clip)
                if seq_acc > 0:
                    # With every sequence filtered out the gradient is KL-only; AdamW's momentum and
                    # decay would still move the weights, defeating the filter as a trust region.
                    opt.update(self.model, grads)
                    mx.eval(self.model.trainable_parameters(), opt.state)
                loss_value, mean_kl = step_loss, kl_sum / max(n_response, 1)
                if step == 0:  # measured before the first update: where the run starts
                    start_kl = mean_kl
                token_fracs.append(tok_acc / max(n_response, 1))
                seq_fracs.append(seq_acc / n_samples)
                elapsed = time.perf_counter() - train_started
                report(Progress(step + 1, cfg.steps, n_seen * (step + 1) / max(elapsed, 1e-9), loss_value))
            train_seconds = time.perf_counter() - train_started

            final_kl = self._mean_kl(batches, ref_lp)  # the KL of what is saved
            report(Progress(cfg.steps, cfg.steps, 0.0, loss_value, phase="saving"))
            self._save(out_dir, spec)

        n_retractions = sum(s.fixed_advantage is not None for s in samples)
        metrics: dict[str, float | int | str] = {
            "ratings_used": n_samples - n_retractions,
            "retractions": n_retractions,
            "mean_advantage": sum(adv_list) / len(adv_list),
            "loss": loss_value,
            "mean_kl": mean_kl,
            "final_mean_kl": final_kl,
            "accepted_token_frac": _mean(token_fracs),
            "accepted_seq_frac": _mean(seq_fracs),
            "tokens_per_s": n_seen * cfg.steps / max(train_seconds, 1e-9),
            "seconds": time.perf_counter() - started,
            "steps": cfg.steps,
            "lr": cfg.lr,
            "n_tokens": n_response,
        }
        ok, reason = run_check(loss_value, start_kl, final_kl, cfg.max_mean_kl)
        return RunResult(
            metrics=metrics,
            advantages={s.rating_id: a for s, a in zip(samples, adv_list, strict=True)},
            promoted_ok=ok,
            reason=reason,
        )

    def _advantages(self, samples: Sequence[TrainSample], ema: float | None, cfg: TrainConfig) -> list[float]:
        """As the torch trainer: :func:`rlfleet.worker.training.advantages.run_advantages`."""
        return run_advantages(samples, ema, cfg.pos_weight, cfg.adv_clip)

    def _fixed_logprobs(
        self,
        encoded: Sequence[Encoded],
        groups: list[list[int]],
        batches: list[dict],
        parent_adapter: Path | None,
    ) -> tuple[list[Any], list[Any]]:
        """Per micro-batch: reference log-probs (LoRA scale 0) and behaviour log-probs.

        Behaviour = the recorded log-probs where encode_sample kept them, the policy at the start
        of the run elsewhere (a fresh LoRA starts exactly at the base, so then the reference pass
        doubles as the behaviour pass)."""
        import numpy as np

        mx = _mx()
        with self._base_only():
            ref = [self._logprobs(b["input_ids"], b["response_mask"]) for b in batches]
            mx.eval(ref)
        need_start = parent_adapter is not None and any(
            encoded[i].behaviour_logprobs is None or len(encoded[i].behaviour_logprobs) < encoded[i].n_response
            for g in groups
            for i in g
        )
        if need_start:
            beh_mx = [self._logprobs(b["input_ids"], b["response_mask"]) for b in batches]
            mx.eval(beh_mx)
        else:
            beh_mx = ref
        beh = []
        for g, b in zip(groups, beh_mx, strict=True):
            arr = np.array(b, dtype=np.float32)
            for row, i in enumerate(g):
                stored = encoded[i].behaviour_logprobs
                if stored:
                    start = encoded[i].prompt_len
                    arr[row, start : start + len(stored)] = np.asarray(stored, dtype=np.float32)
            beh.append(mx.array(arr))
        return ref, beh

    def _mean_kl(self, batches: list[dict], ref: list[Any]) -> float:
        from .objective_mlx import k3_kl

        mx = _mx()
        total = count = 0.0
        for batch, ref_lp in zip(batches, ref, strict=True):
            mask = batch["response_mask"]
            new = self._logprobs(batch["input_ids"], mask)
            kl = mx.where(mask, k3_kl(new, ref_lp), mx.zeros_like(new)).sum()
            total += float(kl)
            count += float(mask.sum())
        return total / max(count, 1)

    # -- evaluation helpers -------------------------------------------------------------------

    def token_logprobs(
        self, pairs: Sequence[tuple[list[dict], str]], adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[list[float]]:
        """Per-token log-probs of each pair's response tokens (end token included) under the base,
        or the base plus the adapter in ``adapter_dir``; the same encoding as training."""
        import numpy as np

        samples = [
            TrainSample(rating_id=i, prompt=p, response=r, reward=0.0) for i, (p, r) in enumerate(pairs)
        ]
        encoded = [encode_sample(self.tokenizer, s, max_tokens) for s in samples]
        groups, batches = self._batches(encoded, 4096)
        result: list[list[float]] = [[] for _ in encoded]
        with contextlib.ExitStack() as stack:
            if adapter_dir is not None:
                stack.enter_context(self._adapter(Path(adapter_dir), None))
            for g, batch in zip(groups, batches, strict=True):
                lp = np.array(self._logprobs(batch["input_ids"], batch["response_mask"]))
                mask = np.array(batch["response_mask"])
                for row, i in enumerate(g):
                    result[i] = lp[row][mask[row]].tolist()
        return result

    def mean_logprobs(
        self, pairs: Sequence[tuple[list[dict], str]], adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[float]:
        """Mean per-token log-prob of each pair's response; see :meth:`token_logprobs`."""
        return [sum(v) / max(len(v), 1) for v in self.token_logprobs(pairs, adapter_dir, max_tokens)]

    def sequence_logprobs(self, prompt: list[dict], response: str, adapter_dir: Path | None) -> float:
        """Mean per-token log-prob of ``response`` after ``prompt``; see :meth:`mean_logprobs`."""
        return self.mean_logprobs([(prompt, response)], adapter_dir)[0]


    def score_model(
        self,
        pairs: Sequence[tuple[list[dict], str]],
        adapter_dir: Path | None,
        cfg: Any,
        max_tokens: int = 1024,
        seed: int = 0,
    ) -> Any:
        """The evaluation gate's measurement (``worker/evaluate.score_model``) on MLX: per answer the
        mean token log-prob, over all answer tokens the exact KL to the base and the next-token
        entropy, and ``cfg.eval_samples`` sampled answers (temperature 0.7) for the
        distinct-bigram and length checks. ``cfg`` is a :class:`rlfleet.worker.gate.GateConfig`."""
        import numpy as np

        from .gate import ModelScores, sample_plan

        mx = _mx()
        samples = [TrainSample(i, p, r, 0.0) for i, (p, r) in enumerate(pairs)]
        encoded = [encode_sample(self.tokenizer, s, max_tokens) for s in samples]
        groups, batches = self._batches(encoded, 4096)
        n = len(encoded)
        lp_sum, ent_sum, kl_sum, count = [0.0] * n, [0.0] * n, [0.0] * n, [0] * n
        with contextlib.ExitStack() as stack:
            if adapter_dir is not None:
                stack.enter_context(self._adapter(Path(adapter_dir), None))
            for g, batch in zip(groups, batches, strict=True):
                ids = batch["input_ids"]
                logp = self._log_softmax(ids)
                p = mx.exp(logp)
                ent = -(p * logp).sum(axis=-1)
                tok = mx.take_along_axis(logp, ids[:, 1:, None], axis=-1).squeeze(-1)
                if adapter_dir is not None:
                    with self._base_only():
                        ref = self._log_softmax(ids)
                    kl = (p * (logp - ref)).sum(axis=-1)
                else:
                    kl = mx.zeros_like(ent)
                pred = np.array(batch["response_mask"])[:, 1:]
                tok_np, ent_np, kl_np = (np.array(a) for a in (tok, ent, kl))
                for row, i in enumerate(g):
                    m = pred[row]
                    lp_sum[i] += float(tok_np[row][m].sum())
                    ent_sum[i] += float(ent_np[row][m].sum())
                    kl_sum[i] += float(kl_np[row][m].sum())
                    count[i] += int(m.sum())
            prompts = sample_plan([prompt for prompt, _r in pairs], cfg.eval_samples)
            sampled = [self._sample(prompt, cfg.eval_new_tokens, seed + j) for j, prompt in enumerate(prompts)]
        return ModelScores.from_sums(lp_sum, ent_sum, kl_sum, count, sampled)

    def _log_softmax(self, ids: Any) -> Any:
        """``[B, L-1, V]`` fp32 next-token log-probs at every position but the last."""
        mx = _mx()
        logits = self.model(ids)[:, :-1].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _sample(self, prompt: list[dict], max_new_tokens: int, seed: int) -> list[int]:
        """Answer token ids (end token excluded) sampled at temperature 0.7, no top-p or top-k."""
        from mlx_lm.generate import generate_step
        from mlx_lm.sample_utils import make_sampler

        from .batching import _ids

        mx = _mx()
        ids = _ids(self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
        eos = self.tokenizer.eos_token_id
        mx.random.seed(seed)
        new: list[int] = []
        steps = generate_step(
            mx.array(ids, dtype=mx.int32), self.model, max_tokens=max_new_tokens, sampler=make_sampler(temp=0.7)
        )
        for token, _logprobs in steps:
            t = int(token)
            if t == eos:
                break
            new.append(t)
        return new


def _mx() -> Any:
    import mlx.core as mx

    return mx


def _peft_key(path: str, which: str) -> str:
    return f"{_PEFT_PREFIX}{path}.lora_{which}.weight"


def _peft_key_ok(key: str, known: set[str]) -> bool:
    if not key.startswith(_PEFT_PREFIX):
        return False
    for which in "AB":
        suffix = f".lora_{which}.weight"
        if key.endswith(suffix):
            return key[len(_PEFT_PREFIX) : -len(suffix)] in known
    return False


def _lora_config(rank: int, alpha: float, paths: list[str], base: str) -> dict:
    """peft's LoraConfig for these modules, as ``adapter_config.json`` holds it."""
    try:
        from peft import LoraConfig
    except ImportError:  # the fields peft needs to load it
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": list(paths),
            "base_model_name_or_path": base,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
        }
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(paths),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
        inference_mode=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        lora.save_pretrained(tmp)  # peft's own serialisation (enums, sets, version field)
        return json.loads((Path(tmp) / "adapter_config.json").read_text(encoding="utf-8"))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
