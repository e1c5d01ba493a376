"""``GET /metrics``: the fleet in Prometheus' text format, read from the database and Redis at each
scrape (prometheus_client's custom-collector pattern), so any process may serve it and every replica
says the same. A sample Grafana dashboard over these names: deploy/grafana/rlfleet.json."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from rlfleet.shared.store import Store

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class FleetCollector:
    """One scrape = one status (``status()``, the dict `rlfleet status --json` prints) plus the store's
    per-source counts and applied events."""

    def __init__(self, store: Store, slug: str, status: Callable[[], dict[str, Any]]) -> None:
        self.store, self.slug, self.status = store, slug, status

    def describe(self) -> list[Metric]:
        return []  # no collection at registration: the database is read at scrape time only

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        ratings = GaugeMetricFamily("rlfleet_ratings", "Active ratings by source, value and whether a run "
                                    "has trained on them", labels=["source", "value", "state"])
        for source, value, pending, n in self.store.counts_by_source(self.slug):
            ratings.add_metric([source, "good" if value > 0 else "bad", "pending" if pending else "trained"], n)
        yield ratings
        applied = CounterMetricFamily("rlfleet_events_applied", "Events the worker has applied, by kind",
                                      labels=["kind"])
        for kind, n in sorted(self.store.applied_events().items()):
            applied.add_metric([kind], n)
        yield applied
        queue = st.get("queue") or {}
        yield GaugeMetricFamily("rlfleet_events_waiting", "Events handed over and not applied yet",
                                value=queue.get("events") or 0)
        yield GaugeMetricFamily("rlfleet_dead_letters", "Events the worker failed on and set aside",
                                value=queue.get("dead_letters") or 0)
        yield GaugeMetricFamily("rlfleet_pending_ratings", "Ratings not trained on yet",
                                value=(st.get("ratings") or {}).get("pending") or 0)
        yield GaugeMetricFamily("rlfleet_threshold", "Pending ratings that start a run", value=st.get("threshold") or 0)
        yield GaugeMetricFamily("rlfleet_workers", "Live workers", value=st.get("workers") or 0)
        yield from self._versions(st)
        yield from self._training(st)
        push = GaugeMetricFamily("rlfleet_push_ok", "Whether the last push to each inference server succeeded",
                                 labels=["target"])
        for result in st.get("push") or []:
            if result.get("ok") is not None:  # None: a manual target, nothing pushed automatically
                push.add_metric([str(result.get("target"))], 1 if result["ok"] else 0)
        yield push

    def _versions(self, st: dict) -> Iterator[Metric]:
        adapter = st.get("adapter") or {}
        versions = adapter.get("versions") or []
        current = adapter.get("current")
        info = InfoMetricFamily("rlfleet_adapter", "The adapter version answering now (base: none)")
        info.add_metric([], {"version": current or "base"})
        yield info
        runs = GaugeMetricFamily("rlfleet_training_runs", "Versions trained, by the gate's verdict",
                                 labels=["verdict"])
        for verdict, n in sorted(Counter(str((v.get("metrics") or {}).get("verdict") or "unchecked")
                                         for v in versions).items()):
            runs.add_metric([verdict], n)
        yield runs
        last = (versions[-1].get("metrics") or {}) if versions else {}
        yield GaugeMetricFamily("rlfleet_last_run_seconds", "How long the latest run took",
                                value=float(last.get("seconds") or 0))
        yield GaugeMetricFamily("rlfleet_last_run_tokens_per_second", "Training tokens per second of the "
                                "latest run", value=float(last.get("tokens_per_s") or 0))

    def _training(self, st: dict) -> Iterator[Metric]:
        training = st.get("training") or {}
        yield GaugeMetricFamily("rlfleet_training_running", "1 while a training run is running",
                                value=1 if training.get("state") == "running" else 0)
        progress = training.get("progress") or {}
        yield GaugeMetricFamily("rlfleet_training_tokens_per_second", "The running run's training tokens per "
                                "second (0 when none runs)", value=float(progress.get("tokens_per_s") or 0))


def exposition(collector: FleetCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
