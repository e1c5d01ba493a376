"""An environment agent's training run in the training worker (``rlfleet.gym``'s ``background=True``):
the contract between the agent's process and the worker's, and the worker's side of it.

The agent sends what a run needs and nothing of its own code: its config (the data dir, the model, the
training settings it was made with), the run's id, the parent version and the batch's samples, each
step with its return and baseline (:class:`GymRunRequest`). The worker trains and commits the candidate
version (:func:`rlfleet.worker.orchestrate.train_candidate`) and hands it back (:func:`candidate_result`).
Judging it on held-out episodes and serving it stay with the agent, where the environment and the
agent's own methods are: a worker never imports user code.
"""

from __future__ import annotations

import functools
import os
from dataclasses import asdict
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from rlfleet.shared.config import Config
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import progress_key
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store

from .context import Context
from .orchestrate import Candidate, ProgressBoard, RunInputs, gate_config, train_candidate
from .samples import TrainSample
from .training.loop import NothingToLearn


class GymRunRequest(BaseModel):
    """One agent run, as the agent enqueues it (JSON: the job's only argument)."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any]  # the agent's Config (model_dump, JSON mode)
    run_id: int
    parent: str | None
    samples: list[dict[str, Any]]  # TrainSample fields

    @classmethod
    def of(cls, cfg: Config, run_id: int, parent: str | None, samples: list[TrainSample]) -> GymRunRequest:
        return cls(config=cfg.model_dump(mode="json"), run_id=run_id, parent=parent,
                   samples=[asdict(s) for s in samples])


def run_in_worker(conn: redis.Redis, payload: str) -> dict[str, Any]:
    """The worker's side: train and commit the candidate of the request in ``payload``; what the agent
    reads back with :func:`candidate_result`."""
    req = GymRunRequest.model_validate_json(payload)
    cfg = Config.model_validate(req.config)
    slug = model_slug(cfg.model)
    ctx = Context(cfg, _store(cfg.db_url), slug, AdapterRegistry(cfg.adapters_root, slug), 0.0)
    inputs = RunInputs(train=[TrainSample(**s) for s in req.samples], held=[], retracted=[])
    board = ProgressBoard(conn, progress_key(slug))  # started by the agent, which also clears it
    try:
        candidate = train_candidate(ctx, req.run_id, inputs, req.parent, gate_config(cfg), board)
    except NothingToLearn as exc:
        return JobResult.failed(str(exc), skipped=True).to_dict()
    return JobResult.done(f"{candidate.version} trained, for the agent to judge", candidate=asdict(candidate),
                          pid=os.getpid()).to_dict()


@functools.lru_cache(maxsize=4)
def _store(db_url: str) -> Store:
    """One store (one engine and its connections) per database for the worker's life, not one a run."""
    return Store(db_url)


def candidate_result(result: dict[str, Any]) -> Candidate:
    """The worker's answer as the candidate it trained; :class:`NothingToLearn` when it trained nothing."""
    if result.get("skipped"):
        raise NothingToLearn(str(result.get("message")))
    c = dict(result["candidate"])
    c["advantages"] = {int(k): float(v) for k, v in c["advantages"].items()}
    return Candidate(**c)
