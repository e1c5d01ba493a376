"""One training run: rated samples in, a LoRA adapter folder and metrics out (DESIGN.md §6).

The base model is loaded once per :class:`Trainer` and kept between runs. Each run wraps it with a
LoRA (fresh, or the parent adapter's weights so the lineage continues) and unwraps it afterwards,
so the base is clean for the next run. Not thread-safe: a run mutates the base's modules in place.

Log-probs are computed in fp32. bf16 autocast is used only on a CUDA device that supports it and
only when no sample brings recorded behaviour log-probs: those are raw fp32 values, and autocast
alone moves sequence ratios by up to about 1 % before any update, enough to make a narrow sequence
band drop most sequences (docs: TESTING.md, pitfalls).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlfleet.shared.models import ModelRef, load_model, load_tokenizer, quiet_peft

from .batching import Encoded, collate, encode_sample, micro_batches
from .objective import k3_kl, loss_for, run_check
from .presets import TrainConfig
from .samples import Progress, RunResult, TrainSample
from .training.advantages import run_advantages

# Config fields that change logits after the output head: with any of them set the cheap path
# (output head on response positions only) would be wrong, so full logits are used instead.
_LOGIT_POSTPROCESSING = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
)


class Trainer:
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
        self.base = base
        for p in self.base.parameters():  # the base is never trained; only LoRA weights are
            p.requires_grad_(False)
        self._n_params = sum(p.numel() for p in self.base.parameters())

    @property
    def n_params(self) -> int:
        return self._n_params

    @property
    def is_moe(self) -> bool:
        cfg = self.base.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        return bool(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None))

    # -- adapters -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _adapter(self, adapter_dir: Path | None, cfg: TrainConfig | None, trainable: bool) -> Iterator[Any]:
        """The base wrapped with a LoRA for the duration of the block; the base is clean afterwards.

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
                weights = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"), device=self.device)
                loaded = set_peft_model_state_dict(model, weights)
                missing = [k for k in loaded.missing_keys if "lora_" in k]
                if loaded.unexpected_keys or missing:
                    raise ValueError(
                        f"adapter {adapter_dir} does not fit {self.ref.spec}: "
                        f"unexpected {loaded.unexpected_keys[:3]}, missing {missing[:3]}"
                    )
            # Eval mode while training too: dropout or router noise would make the trained policy
            # differ from the one the behaviour and reference log-probs were computed with.
            model.eval()
            yield model
        finally:
            model.unload()  # removes the LoRA layers without merging them: the base is untouched
            self.base.eval()

    # -- log-probs ----------------------------------------------------------------------------

    def _autocast(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _use_autocast(self, encoded: Sequence[Encoded]) -> bool:
        return (
            self.device.startswith("cuda")
            and torch.cuda.is_bf16_supported()
            and all(e.behaviour_logprobs is None for e in encoded)
        )

    def _logprobs(self, model: Any, batch: dict[str, Tensor], autocast: bool = False) -> Tensor:
        """``[B, L]`` fp32 log-prob of each response token given its prefix; 0 off the response mask.

        Where the architecture allows, the output head runs on response positions only (hidden
        states are sliced first): the prompt's logits are never needed and cost vocab-sized rows.
        """
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        if bool(resp[:, 0].any()):
            raise ValueError("a response token at position 0 has no context to be predicted from")
        # Token t is predicted from position t-1.
        pred_mask = resp[:, 1:]
        targets = ids[:, 1:][pred_mask]

        body = getattr(lm, getattr(lm, "base_model_prefix", ""), None)
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        config = getattr(lm, "config", None)
        plain_head = not any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_POSTPROCESSING)
        if body is not None and isinstance(head, torch.nn.Linear) and plain_head:
            with self._autocast(autocast):
                hidden = body(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
            hidden = hidden[:, :-1][pred_mask].to(head.weight.dtype)
            logits = head(hidden).float()  # outside autocast: the log-softmax needs fp32 logits
        else:
            with self._autocast(autocast):
                full = lm(input_ids=ids, attention_mask=attn, use_cache=False).logits
            logits = full[:, :-1][pred_mask].float()
        lp = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        # Boolean-mask order is row-major, the same order masked_scatter fills in.
        return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device).masked_scatter(resp, lp)

    def _batches(self, encoded: Sequence[Encoded], budget: int) -> tuple[list[list[int]], list[dict]]:
        groups = micro_batches(encoded, budget)
        pad = self.tokenizer.pad_token_id
        tensors = [
            {k: v.to(self.device) for k, v in collate([encoded[i] for i in g], pad).items()} for g in groups
        ]
        return groups, tensors

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
        if not samples:
            raise ValueError("a training run needs at least one sample")
        started = time.perf_counter()
        report = progress or (lambda _p: None)
        out_dir = Path(out_dir)

        encoded = [encode_sample(self.tokenizer, s, cfg.max_tokens) for s in samples]
        groups, batches = self._batches(encoded, cfg.micro_batch_tokens)
        adv = self._advantages(samples, ema, cfg).to(self.device)
        autocast = self._use_autocast(encoded)
        n_samples = len(samples)
        n_response = sum(e.n_response for e in encoded)
        n_seen = sum(e.length for e in encoded)  # tokens one step runs the model over

        torch.manual_seed(cfg.seed)  # LoRA A init (and anything else random) repeats per seed
        with self._adapter(parent_adapter, cfg, trainable=True) as model:
            report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0, phase="reference"))
            ref_lp, beh_lp = self._fixed_logprobs(model, encoded, groups, batches, parent_adapter, autocast)
            report(Progress(step=0, total=cfg.steps, tokens_per_s=0.0))  # the optimizer steps begin

            loss_fn = loss_for(cfg)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=cfg.lr)
            token_fracs: list[float] = []
            seq_fracs: list[float] = []
            loss_value = mean_kl = start_kl = float("nan")
            train_started = time.perf_counter()
            for step in range(cfg.steps):
                opt.zero_grad(set_to_none=True)
                step_loss = kl_sum = tok_acc = seq_acc = 0.0
                for k, (group, batch) in enumerate(zip(groups, batches, strict=True)):
                    logp_new = self._logprobs(model, batch, autocast)
                    out = loss_fn(logp_new, beh_lp[k], ref_lp[k], batch["response_mask"], adv[group])
                    # Each micro-batch's loss is a mean over its sequences: weighting by its share
                    # of sequences makes the accumulated gradient the mean over the whole step.
                    share = len(group) / n_samples
                    (out.loss * share).backward()
                    step_loss += float(out.loss.detach()) * share
                    kl_sum += out.mean_kl * out.n_tokens
                    tok_acc += out.accepted_token_frac * out.n_tokens
                    seq_acc += out.accepted_seq_frac * len(group)
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                if seq_acc > 0:
                    # With every sequence filtered out the gradient is KL-only; AdamW's momentum and
                    # decay would still move the weights, defeating the filter as a trust region.
                    opt.step()
                loss_value, mean_kl = step_loss, kl_sum / max(n_response, 1)
                if step == 0:  # measured before the first update: where the run starts
                    start_kl = mean_kl
                token_fracs.append(tok_acc / max(n_response, 1))
                seq_fracs.append(seq_acc / n_samples)
                elapsed = time.perf_counter() - train_started
                report(Progress(step + 1, cfg.steps, n_seen * (step + 1) / max(elapsed, 1e-9), loss_value))
            train_seconds = time.perf_counter() - train_started

            # The KL of what is saved (the last step's figure predates its own update).
            final_kl = self._mean_kl(model, groups, batches, ref_lp, autocast)
            report(Progress(cfg.steps, cfg.steps, 0.0, loss_value, phase="saving"))
            out_dir.mkdir(parents=True, exist_ok=True)
            with quiet_peft():
                model.save_pretrained(str(out_dir))

        n_retractions = sum(s.fixed_advantage is not None for s in samples)
        metrics: dict[str, float | int | str] = {
            "ratings_used": n_samples - n_retractions,
            "retractions": n_retractions,
            "mean_advantage": float(adv.mean()),
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
            advantages={s.rating_id: float(a) for s, a in zip(samples, adv.tolist(), strict=True)},
            promoted_ok=ok,
            reason=reason,
        )

    def _advantages(self, samples: Sequence[TrainSample], ema: float | None, cfg: TrainConfig) -> Tensor:
        """The advantages of :func:`rlfleet.worker.training.advantages.run_advantages`, as a tensor."""
        return torch.tensor(run_advantages(samples, ema, cfg.pos_weight, cfg.adv_clip), dtype=torch.float32)

    @torch.no_grad()
    def _fixed_logprobs(
        self,
        model: Any,
        encoded: Sequence[Encoded],
        groups: list[list[int]],
        batches: list[dict],
        parent_adapter: Path | None,
        autocast: bool,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Per micro-batch: reference log-probs (adapter disabled) and behaviour log-probs.

        Behaviour = the recorded log-probs where encode_sample kept them, the policy at the start
        of the run elsewhere. A fresh LoRA starts exactly at the base (B = 0), so then the
        reference pass doubles as the behaviour pass.
        """
        with model.disable_adapter():
            ref = [self._logprobs(model, b, autocast) for b in batches]
        need_start = parent_adapter is not None and any(
            encoded[i].behaviour_logprobs is None
            or len(encoded[i].behaviour_logprobs) < encoded[i].n_response
            for g in groups
            for i in g
        )
        if need_start:
            beh = [self._logprobs(model, b, autocast) for b in batches]
        else:
            beh = [r.clone() for r in ref]
        for g, b in zip(groups, beh, strict=True):
            for row, i in enumerate(g):
                stored = encoded[i].behaviour_logprobs
                if stored:
                    start = encoded[i].prompt_len
                    b[row, start : start + len(stored)] = torch.tensor(stored, dtype=b.dtype, device=b.device)
        return ref, beh

    @torch.no_grad()
    def _mean_kl(
        self, model: Any, groups: list[list[int]], batches: list[dict], ref: list[Tensor], autocast: bool
    ) -> float:
        total = count = 0.0
        for batch, ref_lp in zip(batches, ref, strict=True):
            mask = batch["response_mask"]
            new = self._logprobs(model, batch, autocast)
            total += float(k3_kl(new[mask], ref_lp[mask]).sum())
            count += int(mask.sum())
        return total / max(count, 1)

    # -- evaluation helpers -------------------------------------------------------------------

    @torch.no_grad()
    def token_logprobs(
        self, pairs: Sequence[tuple[list[dict], str]], adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[list[float]]:
        """Per-token log-probs of each ``(prompt, response)`` pair's response tokens (end token
        included) under the base, or the base plus the adapter in ``adapter_dir``; fp32, the same
        encoding and computation as training, so usable as recorded behaviour log-probs."""
        samples = [
            TrainSample(rating_id=i, prompt=p, response=r, reward=0.0) for i, (p, r) in enumerate(pairs)
        ]
        encoded = [encode_sample(self.tokenizer, s, max_tokens) for s in samples]
        groups, batches = self._batches(encoded, 4096)
        result: list[list[float]] = [[] for _ in encoded]
        with contextlib.ExitStack() as stack:
            model = self.base
            if adapter_dir is not None:
                model = stack.enter_context(self._adapter(Path(adapter_dir), None, trainable=False))
            for g, batch in zip(groups, batches, strict=True):
                lp = self._logprobs(model, batch)
                for row, i in enumerate(g):
                    result[i] = lp[row][batch["response_mask"][row]].tolist()
        return result

    def mean_logprobs(
        self, pairs: Sequence[tuple[list[dict], str]], adapter_dir: Path | None = None, max_tokens: int = 1024
    ) -> list[float]:
        """Mean per-token log-prob of each pair's response; see :meth:`token_logprobs`."""
        return [sum(v) / max(len(v), 1) for v in self.token_logprobs(pairs, adapter_dir, max_tokens)]

    def sequence_logprobs(self, prompt: list[dict], response: str, adapter_dir: Path | None) -> float:
        """Mean per-token log-prob of ``response`` after ``prompt``; see :meth:`mean_logprobs`."""
        return self.mean_logprobs([(prompt, response)], adapter_dir)[0]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
