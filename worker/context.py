"""What every job of a worker process works with, and how a job gets it.

One :class:`Context` per process, built on first use and rebuilt when ``config.toml`` changes (so
`rlfleet init` applies without restarting the workers). A job's Redis connection is not part of it:
RQ hands each job its own (:func:`current_job`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rq import get_current_job
from rq.job import Job

from rlfleet.shared import scopes
from rlfleet.shared.applied import TrainModel
from rlfleet.shared.config import Config, load_config
from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.models import model_slug
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store


@dataclass(frozen=True)
class Context:
    cfg: Config
    store: Store
    slug: str  # the model this worker trains and serves: ratings, runs and versions are kept per model
    registry: AdapterRegistry  # that model's adapter versions
    config_mtime: float  # of the config.toml it was built from (0.0: none)

    def scoped(self, lineage: str) -> Context:
        """This context for one lineage of its model (shared/scopes.py): that scope's ratings, runs,
        baseline and versions; itself for its own."""
        if lineage == self.slug:
            return self
        if scopes.split(lineage)[0] != scopes.split(self.slug)[0]:
            raise RlfleetError(f"this worker trains {self.slug}, not {lineage}; start one with that model")
        return replace(self, slug=lineage, registry=AdapterRegistry(self.cfg.adapters_root, lineage))

    @property
    def train_model(self) -> TrainModel:
        """What the store files a new rating under: the model's slug, or each rating's own scope's
        lineage when the config gives any rating a scope of its own."""
        if not self.cfg.scoped:
            return self.slug
        cfg, slug = self.cfg, self.slug
        return lambda ev, conversation: cfg.lineage_of(slug, ev.source, ev.actor, conversation)


_CTX: Context | None = None


def context() -> Context:
    """This process's context, rebuilt when config.toml changed since it was built."""
    global _CTX
    cfg_path = load_config().config_path
    mtime = cfg_path.stat().st_mtime if cfg_path.exists() else 0.0
    if _CTX is None or _CTX.config_mtime != mtime:
        cfg = load_config()
        slug = model_slug(cfg.model)
        _CTX = Context(cfg, Store(cfg.db_url), slug, AdapterRegistry(cfg.adapters_root, slug), mtime)
    return _CTX


def current_job() -> Job:
    """The RQ job running now: its id, and the Redis connection RQ gave it."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("rlfleet jobs run inside an RQ worker")
    return job
