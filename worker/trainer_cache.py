"""The trainer of this process: the base model stays loaded between runs, one trainer per (model,
device), and the training worker loads it as it starts instead of when the first run comes."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from rlfleet.shared.config import Config

log = logging.getLogger("rlfleet.worker")

_TRAINERS: dict[tuple[str, str], Any] = {}
_TRAINERS_LOCK = threading.Lock()  # a run that starts while the worker preloads waits for that load


def get_trainer(cfg: Config) -> Any:
    """The trainer for ``cfg``'s model and device, loaded on first use."""
    from rlfleet.shared.models import pick_device, resolve_model

    from .backends import make_trainer

    ref = resolve_model(cfg.model)
    device = pick_device(cfg.train.device)
    key = (ref.path + (ref.gguf_file or ""), device)
    with _TRAINERS_LOCK:
        if key not in _TRAINERS:
            _TRAINERS[key] = make_trainer(ref, device)
        trainer = _TRAINERS[key]
    trainer.draw_with(cfg.chat.engine)  # llama.cpp draws the run's samples where it draws the chat's
    trainer.parallel_batches(cfg.train.parallel_batches)
    return trainer


def forget_trainers() -> None:
    """Let go of this process's trainers (one that needed a model for a moment: a benchmark's set-up)."""
    with _TRAINERS_LOCK:
        _TRAINERS.clear()


def preload_trainer(cfg: Config) -> threading.Thread:
    """Load the model in the background as the training worker starts. A failure is only logged: the
    first run loads again and says why in status."""

    def load() -> None:
        started = time.monotonic()
        try:
            get_trainer(cfg).draw_with(cfg.chat.engine, load=True)
        except Exception as exc:
            log.warning("could not preload %s (%s); the first training run will try again", cfg.model, exc)
        else:
            log.info("preloaded %s in %.1f s", cfg.model, time.monotonic() - started)

    thread = threading.Thread(target=load, name="rlfleet-preload", daemon=True)
    thread.start()
    return thread
