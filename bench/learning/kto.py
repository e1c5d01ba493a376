"""TRL's KTOTrainer as a learning signal of the worker's training loop: the learning benchmark's KTO baseline.

:class:`KtoTrainer` wraps an existing torch :class:`~rlfleet.worker.training.torch_backend.Trainer`
(the base model is loaded once and shared) and runs the same training loop
(:func:`rlfleet.worker.training.loop.run_training`) with :class:`Kto` as its learning signal instead
of the worker's: the same ratings at the same compute (``cfg.steps`` optimizer steps, each over every
sample once, at ``cfg.lr``), the same LoRA (rank, alpha, all linear layers), AdamW settings, gradient
clip and seed, the adapter saved exactly as the worker's registry expects, the same metric keys.

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
  after the adapter is saved, and the loop's adapter session unloads the LoRA, so the base is exactly
  as before.
* TRL keeps no per-token KL of its own: the run's KL figures are the saved adapter's, measured by the
  loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlfleet.shared.chat_prompt import prompt_ids
from rlfleet.shared.models import quiet_peft
from rlfleet.worker.presets import TrainConfig
from rlfleet.worker.samples import Progress, RunResult, TrainSample
from rlfleet.worker.training.backend import Backend
from rlfleet.worker.training.loop import Outcome, Report, RunData, RunRequest, Selection, run_training
from rlfleet.worker.training.torch_backend import Trainer

KTO_BETA = 0.1  # TRL's default; not cfg.beta, which weights our objective's KL term (a different scale)


class KtoTrainer:
    """The torch Trainer with KTO as its learning signal: ``run`` trains with KTO; everything else
    (the measurements, the backend operations the gate and the benchmark call) is the Trainer's."""

    def __init__(self, trainer: Trainer, beta: float = KTO_BETA) -> None:
        self.trainer = trainer
        self.beta = beta

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally (base, tokenizer, adapter, mean_logprobs, ...).
        trainer = self.__dict__.get("trainer")
        if trainer is None:
            raise AttributeError(name)
        return getattr(trainer, name)

    def run(
        self,
        samples: list[TrainSample],
        ema: float | None,
        cfg: TrainConfig,
        parent_adapter: Path | None,
        out_dir: Path,
        progress: Callable[[Progress], None] | None = None,
        captured: Sequence[list[dict]] = (),
        history: Sequence[TrainSample] = (),
        halfway_dir: Path | None = None,
    ) -> RunResult:
        """Train ``cfg.steps`` KTO steps over ``samples``; save the adapter to ``out_dir``.

        ``ema`` is not used: KTO has no reward baseline, only desirable/undesirable labels. TRL's
        trainer runs its steps in one call, so no halfway adapter is saved (``halfway_dir`` stays
        empty): a KTO version the gate refuses has no smaller step to fall back on.
        """
        run = RunRequest(samples, ema, cfg, parent_adapter, out_dir, progress, captured, history, halfway_dir)
        return run_training(self.trainer, Kto(self.beta), run)


class Kto:
    """TRL's KTO as a learning signal (torch backend only)."""

    def __init__(self, beta: float = KTO_BETA) -> None:
        self.beta = beta

    def select(self, backend: Backend, samples: list[TrainSample], ema: float | None, cfg: TrainConfig) -> Selection:
        """Labels as advantages: +1 desirable (a positive reward), -1 undesirable.

        A retraction (fixed_advantage set) undoes an update an earlier run made: it is trained with
        the opposite label, i.e. the sign of its fixed advantage (the same direction our Trainer
        pushes it); a zero one has no direction and is skipped. Samples whose prompt alone fills
        max_tokens are skipped too: TRL truncates from the right and would drop them itself, after
        the batch shape is fixed.
        """
        kept: list[TrainSample] = []
        labels: list[float] = []
        for s in samples:
            label = s.reward > 0 if s.fixed_advantage is None else s.fixed_advantage > 0
            if s.fixed_advantage == 0:
                continue
            if len(prompt_ids(backend.tokenizer, s.prompt)) >= cfg.max_tokens:
                continue
            kept.append(s)
            labels.append(1.0 if label else -1.0)
        if not kept:
            raise ValueError("no sample is trainable with KTO (all zero retractions or over max_tokens)")
        return Selection(kept, labels, mean_advantage=0.0)  # labels, not advantages: none to report

    @contextlib.contextmanager
    def train(self, backend: Any, session: Any, data: RunData, cfg: TrainConfig, report: Report) -> Iterator[Outcome]:
        rows = [
            {"prompt": list(s.prompt), "completion": [{"role": "assistant", "content": s.response}], "label": a > 0}
            for s, a in zip(data.samples, data.advantages, strict=True)
        ]
        random.Random(cfg.seed).shuffle(rows)
        if len(rows) == 1:
            rows = rows * 2  # KTO's KL estimate needs a batch of at least 2; see the module docstring
        n_seen = data.n_seen  # tokens one step runs the policy over, as in our Trainer
        batch, accumulation = _batch_shape(len(rows), max(e.length for e in data.encoded), cfg.micro_batch_tokens)
        step_losses: list[float] = []
        train_started = [time.perf_counter()]
        with (
            tempfile.TemporaryDirectory(prefix="rlfleet-kto-") as scratch,
            # TRL runs the model its own way (fp32 on a CPU, its own autocast on CUDA): the base's
            # fp32 weights, not the ones a bf16 session holds for our own passes.
            backend.full_precision(),
            _restore_base(backend.base),
            _quiet_datasets(),
            quiet_peft(),
        ):
            args = _kto_config(
                cfg, scratch, backend.device, self.beta, batch, accumulation, _balanced_weights(rows)
            )
            kto = _build_trainer(
                session,
                backend.tokenizer,
                rows,
                args,
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
                # Open while the loop saves the adapter (the "default" one only: "ref" was deleted).
                yield Outcome(
                    loss=_last(step_losses),
                    train_seconds=train_seconds,
                    accepted_token_frac=1.0,
                    accepted_seq_frac=1.0,
                    extra={
                        "objective": "kto",
                        "skipped": len(data.given) - len(data.samples),  # zero retractions, prompts over max_tokens
                        "kto_beta": self.beta,
                        "batch_size": batch,
                        "grad_accumulation": accumulation,
                    },
                )
            finally:
                kto.accelerator.free_memory()
                del kto


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


def _balanced_weights(rows: list[dict]) -> tuple[float, float]:
    """``(desirable_weight, undesirable_weight)``: the KTO paper's (Eq. 8) balance, the rarer label
    weighted up so both sides pull equally (TRL warns when the weights are outside that range)."""
    n_desirable = sum(r["label"] for r in rows)
    n_undesirable = len(rows) - n_desirable
    if not (n_desirable and n_undesirable):
        return 1.0, 1.0
    if n_desirable < n_undesirable:
        return n_undesirable / n_desirable, 1.0
    return 1.0, n_desirable / n_undesirable


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


def _kto_config(
    cfg: TrainConfig,
    scratch: str,
    device: str,
    beta: float,
    batch: int,
    accumulation: int,
    weights: tuple[float, float],
) -> Any:
    """TRL's settings for one run: ours where TRL's defaults differ (see the module docstring)."""
    from trl import KTOConfig

    on_cpu = device == "cpu"
    # TRL turns activation checkpointing on by default (it also hooks the input embeddings); off,
    # as in our Trainer. transformers 5 renamed the field and warns on the old name.
    names = {f.name for f in dataclasses.fields(KTOConfig)}
    no_checkpointing = {
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": False
    }
    return KTOConfig(
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
        desirable_weight=weights[0],
        undesirable_weight=weights[1],
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


def _build_trainer(
    model: Any,
    tok: Any,
    rows: list[dict],
    args: Any,
    *,
    step_losses: list[float],
    on_step: Callable[[int, float], None],
) -> Any:
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import KTOTrainer

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

    # TRL warns about the desirable/undesirable weights whenever the label counts differ. They are
    # balanced by _balanced_weights when both labels occur; with one label only there is nothing to balance.
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
