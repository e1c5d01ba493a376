"""Which trainer a device means: the MLX trainer for ``"mlx"``, the torch trainer otherwise.

Both are backends of the one training loop (:mod:`rlfleet.worker.training`): the same interface
(``run``, ``n_params``, ``is_moe``, ``tokenizer``, ``mean_logprobs``, ``score_model``) and the same
peft adapters, so the rest of the worker does not care which one ran.
"""

from __future__ import annotations

from typing import Any

from rlfleet.shared.models import ModelRef


def make_trainer(ref: ModelRef, device: str) -> Any:
    """A trainer for ``ref`` on ``device`` (a value from :func:`rlfleet.shared.models.pick_device`)."""
    if device == "mlx":
        from .training.mlx_backend import MlxTrainer

        return MlxTrainer(ref, device=device)
    from .training.torch_backend import Trainer

    return Trainer(ref, device=device)
