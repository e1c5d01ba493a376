"""Which trainer a device means: the MLX trainer for ``"mlx"``, the torch trainer otherwise.

Both have the same interface (``run``, ``n_params``, ``is_moe``, ``tokenizer``, ``mean_logprobs``)
and write the same peft adapters, so the rest of the worker does not care which one ran.
"""

from __future__ import annotations

from typing import Any

from rlfleet.shared.models import ModelRef


def make_trainer(ref: ModelRef, device: str) -> Any:
    """A trainer for ``ref`` on ``device`` (a value from :func:`rlfleet.shared.models.pick_device`)."""
    if device == "mlx":
        from .mlx_trainer import MlxTrainer

        return MlxTrainer(ref, device=device)
    from .trainer import Trainer

    return Trainer(ref, device=device)
