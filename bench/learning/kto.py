"""TRL's KTOTrainer behind the rlfleet trainer interface: the learning benchmark's KTO baseline.

:class:`KtoTrainer` wraps an existing torch :class:`~rlfleet.worker.training.torch_backend.Trainer` (the base model is
loaded once and shared) and trains the same ratings with ``trl.KTOTrainer`` instead of our objective,
at the same compute: ``cfg.steps`` optimizer steps, each over every sample once, at ``cfg.lr``, with
the same LoRA (rank, alpha, all linear layers), AdamW settings, gradient clip and seed. The adapter is
written exactly as the worker's registry expects (adapter_config.json + adapter_model.safetensors) and
the returned :class:`RunResult` carries the torch Trainer's metric keys.

What TRL needs or does on its own, and what is done about it here:

* The reference is the base (adapter disabled), as in our Trainer. TRL does that itself only for a
  fresh ``peft_config``; handed a PeftModel (ours, which may hold a parent adapter) it adds a frozen
  copy "ref" of the adapter and uses that instead, so the copy is deleted before training.
* KTO estimates its KL baseline from mismatched (prompt, completion) pairs, built by rotating the
  completions by one inside each per-device batch, so that batch needs at least 2 samples: the batch
  is a divisor of the sample count >= 2 (gradient accumulation makes up the rest of the step), and a
  single sample is duplicated (the same gradient; its KL estimate is then its own log-ratio). The
  samples are shuffled (seeded) first: ratings come in prompt-adjacent pairs, and the rotation would
  otherwise pair each prompt with its own other answer.
* TRL's defaults that differ from ours are set explicitly: no gradient checkpointing, no bf16 on CPU,
  constant learning rate (the transformers default decays it linearly to 0), AdamW weight decay 0.01
  and ``max_grad_norm = cfg.grad_clip`` (our Trainer's), no dropout changes, no telemetry, no logging
  integrations, no checkpoints. Forward passes run in eval mode, as our Trainer's do.
* TRL patches the base model: a fused LM head replaces ``base.forward``, tags, pad ids. Each is put back
  afterwards, and the LoRA is unloaded by ``Trainer.adapter``, so the base is exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rlfleet.shared.models import quiet_peft
from rlfleet.worker.batching import _ids, encode_sample
from rlfleet.worker.presets import TrainConfig
from rlfleet.worker.samples import Progress, RunResult, TrainSample
from rlfleet.worker.training.torch_backend import Trainer

KTO_BETA = 0.1  # TRL's default; not cfg.beta, which weights our objective's KL term (a different scale)


class KtoTrainer:
    """The torch Trainer's interface (``run`` and the evaluation helpers), training with TRL's KTO."""

    def __init__(self, trainer: Trainer, beta: float = KTO_BETA) -> None:
        self.trainer = trainer
        self.beta = beta

    # -- delegated to the wrapped Trainer -----------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally (adapter, batches, sequence_logprobs, ...).
        trainer = self.__dict__.get("trainer")
        if trainer is None:
            raise AttributeError(name)
        return getattr(trainer, name)

    @property
    def base(self) -> Any:
        return self.trainer.base

    @property
    def tokenizer(self) -> Any:
        return self.trainer.tokenizer

    @property
    def device(self) -> str:
        return self.trainer.device

    @property
    def ref(self) -> Any:
        return self.trainer.ref

    @property
    def n_params(self) -> int:
        return self.trainer.n_params

    @property
    def is_moe(self) -> bool:
        return self.trainer.is_moe

    def token_logprobs(self, *args: Any, **kwargs: Any) -> list[list[float]]:
        return self.trainer.token_logprobs(*args, **kwargs)

    def mean_logprobs(self, *args: Any, **kwargs: Any) -> list[float]:
        return self.trainer.mean_logprobs(*args, **kwargs)

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
        """Train ``cfg.steps`` KTO steps over all ``samples``; save the adapter to ``out_dir``.

        ``ema`` is not used: KTO has no reward baseline, only desirable/undesirable labels.
        """
        del ema
        if not samples:
            raise ValueError("a training run needs at least one sample")
        started = time.perf_counter()
        report = progress or (lambda _p: None)
        out_dir = Path(out_dir)
        tok = self.tokenizer

        # Labels: a rating is desirable when its reward is positive. A retraction (fixed_advantage
        # set) undoes an update an earlier run made: it is trained with the opposite label, i.e. the
        # sign of its fixed advantage (the same direction our Trainer pushes it); a zero one has no
        # direction and is skipped. Samples whose prompt alone fills max_tokens are skipped too:
        # TRL truncates from the right and would drop them itself, after the batch shape is fixed.
        rows: list[dict] = []
        kept: list[TrainSample] = []
        labels: dict[int, float] = {}
        for s in samples:
            label = s.reward > 0 if s.fixed_advantage is None else s.fixed_advantage > 0
            if s.fixed_advantage == 0:
                continue
            prompt_len = len(_ids(tok.apply_chat_template(s.prompt, add_generation_prompt=True, tokenize=True)))
            if prompt_len >= cfg.max_tokens:
                continue
            rows.append(
                {"prompt": list(s.prompt), "completion": [{"role": "assistant", "content": s.response}], "label": label}
            )
            kept.append(s)
            labels[s.rating_id] = 1.0 if label else -1.0
        if not rows:
            raise ValueError("no sample is trainable with KTO (all zero retractions or over max_tokens)")
        random.Random(cfg.seed).shuffle(rows)
        if len(rows) == 1:
            rows = rows * 2  # KTO's KL estimate needs a batch of at least 2; see the module docstring

        encoded = [encode_sample(tok, s, cfg.max_tokens) for s in kept]
        n_response = sum(e.n_response for e in encoded)
        n_seen = sum(e.length for e in encoded)  # tokens one step runs the policy over, as in our Trainer
        batch, accumulation = _batch_shape(len(rows), max(e.length for e in encoded), cfg.micro_batch_tokens)

        n_desirable = sum(r["label"] for r in rows)
        n_undesirable = len(rows) - n_desirable
        # The KTO paper's (Eq. 8) balance: weight the rarer label up so both sides pull equally
        # (TRL warns when the weights are outside that range).
        desirable_weight = undesirable_weight = 1.0
        if n_desirable and n_undesirable:
            if n_desirable < n_undesirable:
                desirable_weight = n_undesirable / n_desirable
            else:
                undesirable_weight = n_desirable / n_undesirable

        step_losses: list[float] = []
        train_started = [time.perf_counter()]

        torch.manual_seed(cfg.seed)  # LoRA A init repeats per seed, as in our Trainer
        with (
            tempfile.TemporaryDirectory(prefix="rlfleet-kto-") as scratch,
            self.trainer.adapter(parent_adapter, cfg, trainable=True) as model,
            _restore_base(self.base),
            _quiet_datasets(),
            quiet_peft(),
        ):
            kto = _build_trainer(
                model,
                tok,
                rows,
                cfg,
                scratch=scratch,
                device=self.device,
                beta=self.beta,
                batch=batch,
                accumulation=accumulation,
                desirable_weight=desirable_weight,
                undesirable_weight=undesirable_weight,
                step_losses=step_losses,
                on_step=lambda step, loss: report(
                    Progress(
                        step,
                        cfg.steps,
                        n_seen * step / max(time.perf_counter() - train_started[0], 1e-9),
                        loss,
                    )
                ),
            )
            try:
                train_started[0] = time.perf_counter()
                kto.train()
                train_seconds = time.perf_counter() - train_started[0]
                report(Progress(cfg.steps, cfg.steps, 0.0, _last(step_losses), phase="saving"))
                out_dir.mkdir(parents=True, exist_ok=True)
                model.save_pretrained(str(out_dir))  # the "default" adapter only: "ref" was deleted
            finally:
                kto.accelerator.free_memory()
                del kto

        # KL of the saved adapter to the base on the training samples, per token (k3 estimator),
        # through the wrapped Trainer's own log-prob path: the figure our Trainer reports.
        pairs = [(s.prompt, s.response) for s in kept]
        ref_lp = self.trainer.token_logprobs(pairs, None, cfg.max_tokens)
        new_lp = self.trainer.token_logprobs(pairs, out_dir, cfg.max_tokens)
        final_kl = _mean_k3(new_lp, ref_lp)
        loss_value = _last(step_losses)

        n_retractions = sum(s.fixed_advantage is not None for s in samples)
        metrics: dict[str, float | int | str] = {
            "ratings_used": len(samples) - n_retractions,
            "retractions": n_retractions,
            "mean_advantage": 0.0,
            "loss": loss_value,
            "mean_kl": final_kl,  # TRL keeps no per-token KL of its own: the saved adapter's figure
            "final_mean_kl": final_kl,
            "accepted_token_frac": 1.0,
            "accepted_seq_frac": 1.0,
            "tokens_per_s": n_seen * cfg.steps / max(train_seconds, 1e-9),
            "seconds": time.perf_counter() - started,
            "steps": cfg.steps,
            "lr": cfg.lr,
            "n_tokens": n_response,
            "objective": "kto",
            "skipped": len(samples) - len(kept),  # zero retractions, prompts over max_tokens
            "kto_beta": self.beta,
            "batch_size": batch,
            "grad_accumulation": accumulation,
        }
        ok, reason = True, None
        if not math.isfinite(loss_value) or not math.isfinite(final_kl):
            ok, reason = False, f"training diverged: loss {loss_value}, mean KL {final_kl}"
        return RunResult(metrics=metrics, advantages=labels, promoted_ok=ok, reason=reason)


# -- helpers ------------------------------------------------------------------------------------


def _batch_shape(n: int, longest: int, budget: int) -> tuple[int, int]:
    """``(per-device batch, accumulation steps)`` with ``batch * accumulation == n``, batch >= 2.

    The largest divisor of ``n`` whose padded size fits ``budget`` tokens, else the smallest one
    >= 2 (KTO's KL estimate needs 2; a prime ``n`` gets one batch of all).
    """
    if n < 2:
        raise ValueError("KTO needs at least 2 samples per batch")
    divisors = [d for d in range(2, n + 1) if n % d == 0]
    fitting = [d for d in divisors if d * longest <= budget]
    batch = max(fitting) if fitting else min(divisors)
    return batch, n // batch


def _mean_k3(new: list[list[float]], ref: list[list[float]]) -> float:
    total = count = 0.0
    for n_seq, r_seq in zip(new, ref, strict=True):
        for n_lp, r_lp in zip(n_seq, r_seq, strict=True):
            d = r_lp - n_lp
            total += math.exp(d) - d - 1.0
            count += 1
    return total / max(count, 1)


def _last(values: list[float]) -> float:
    return values[-1] if values else float("nan")


@contextlib.contextmanager
def _restore_base(base: Any) -> Iterator[None]:
    """Undo what TRL writes onto the base model: the fused-head ``forward``, tags and pad ids."""
    had_forward = "forward" in vars(base)
    forward = vars(base).get("forward")
    tags = list(base.model_tags) if base.model_tags is not None else None
    text_cfg = base.config.get_text_config()
    pad = text_cfg.pad_token_id
    gen_cfg = getattr(base, "generation_config", None)
    gen_pad = getattr(gen_cfg, "pad_token_id", None)
    try:
        yield
    finally:
        if had_forward:
            base.forward = forward
        else:
            vars(base).pop("forward", None)
        base.model_tags = tags
        text_cfg.pad_token_id = pad
        if gen_cfg is not None:
            gen_cfg.pad_token_id = gen_pad


def _drop_weight_advice(record: logging.LogRecord) -> bool:
    return "desirable/positive and undesirable/negative" not in record.getMessage()


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No per-``map`` progress bars from datasets while TRL tokenizes a few dozen rows."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _build_trainer(
    model: Any,
    tok: Any,
    rows: list[dict],
    cfg: TrainConfig,
    *,
    scratch: str,
    device: str,
    beta: float,
    batch: int,
    accumulation: int,
    desirable_weight: float,
    undesirable_weight: float,
    step_losses: list[float],
    on_step: Callable[[int, float], None],
) -> Any:
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import KTOConfig, KTOTrainer

    class _KTO(KTOTrainer):
        def _send_telemetry(self) -> None:  # a benchmark run phones nobody
            pass

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # transformers' training_step puts the model in train mode; ours trains in eval mode (no
            # dropout or router noise), so do the same. TRL then files its metrics under "eval".
            model.eval()
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            self._micro_losses.append(float(loss.detach()))
            return out

    class _StepReport(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            micro = kto._micro_losses
            # Equal-sized micro-batches, each loss a mean: the step's loss is their mean.
            loss = sum(micro) / len(micro) if micro else float("nan")
            micro.clear()
            step_losses.append(loss)
            on_step(state.global_step, loss)

    on_cpu = device == "cpu"
    # TRL turns activation checkpointing on by default (it also hooks the input embeddings); off,
    # as in our Trainer. transformers 5 renamed the field and warns on the old name.
    names = {f.name for f in dataclasses.fields(KTOConfig)}
    no_checkpointing = {
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False
    }
    args = KTOConfig(
        **no_checkpointing,
        output_dir=scratch,
        max_steps=cfg.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        learning_rate=cfg.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=0.01,  # torch.optim.AdamW's default, which our Trainer uses
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=cfg.grad_clip,
        beta=beta,
        loss_type="kto",
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        max_length=cfg.max_tokens,
        seed=cfg.seed,
        data_seed=cfg.seed,
        use_cpu=on_cpu,
        bf16=(not on_cpu and device.startswith("cuda") and torch.cuda.is_bf16_supported()),
        fp16=False,
        disable_dropout=False,  # it would set the shared base's Dropout modules to 0 for good; eval mode instead
        eval_strategy="no",
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_pin_memory=not on_cpu,
        remove_unused_columns=True,
    )
    # TRL warns about the desirable/undesirable weights whenever the label counts differ. They are
    # balanced above when both labels occur; with one label only there is nothing to balance.
    trl_log = logging.getLogger(KTOTrainer.__module__)
    trl_log.addFilter(_drop_weight_advice)
    try:
        kto = _KTO(
            model=model,
            ref_model=None,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            callbacks=[_StepReport()],
        )
    finally:
        trl_log.removeFilter(_drop_weight_advice)
    kto._micro_losses = []
    # Handed a PeftModel, TRL made a frozen copy of its adapter the reference; ours is the base.
    if "ref" in model.peft_config:
        model.delete_adapter("ref")
        model.set_adapter("default")
    for cb in (PrinterCallback, ProgressCallback):
        kto.remove_callback(cb)
    if len(kto.train_dataset) != len(rows):
        raise RuntimeError(f"TRL dropped {len(rows) - len(kto.train_dataset)} of {len(rows)} rows")
    return kto
