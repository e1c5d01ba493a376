"""The embedded Redis SIGKILLed right after it acknowledged ratings (no SHUTDOWN, so no fsync on the
way out), started again on the same data dir: every acknowledged rating is stored, exactly once.

The first cut comes with no worker running, so every rating it acknowledged exists only in Redis's
append-only file; the later ones come while an events worker drains (a batch half applied, an answer
half written). The server is checked to run ``appendfsync always`` before and after every restart.

What this can and cannot show: SIGKILL ends the process, not the machine, so what Redis had written
to its file but not fsynced is still in the OS page cache and survives; ``appendfsync everysec``
would most likely pass this test too. The power cut that ``always`` protects against (the page cache
lost) cannot be caused from a test; that the server really runs ``always`` is asserted instead, and
what the test proves is that nothing acknowledged depends on a graceful shutdown or on a drain that
finished."""

from __future__ import annotations

import os
import signal
import time

from chaosrig import env_for, stop, stored_counts, tail, worker

from rlfleet.shared import durability
from rlfleet.shared.config import load_config
from rlfleet.shared.embedded_redis import EmbeddedRedis, pid_alive
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.queue import enqueue_event, open_queue
from rlfleet.shared.store import Store

PER_CUT, CUTS = 150, 4


def _cut(emb: EmbeddedRedis) -> int:
    """SIGKILL the server and wait until it is gone; its pid."""
    pid = emb._server_pid()
    assert pid is not None and pid_alive(pid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(pid):
        assert time.monotonic() < deadline, "redis-server outlived SIGKILL"
        time.sleep(0.01)
    return pid


def test_every_rating_acknowledged_before_a_sigkill_of_the_embedded_redis_is_stored(home, tmp_path):
    cfg = load_config(model="tiny")
    cfg.train.threshold = 100_000  # no training in the way
    cfg.save()
    store = Store(cfg.db_url)
    store.apply_many([Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")],
                              response=f"a{i}", model="tiny") for i in range(PER_CUT * CUTS)], "tiny")
    handle = open_queue(cfg)
    emb = handle.embedded
    assert emb is not None, "the test needs the embedded server (no REDIS_URL)"
    log = tmp_path / "worker.log"
    proc = None
    acked: list[str] = []
    only_in_redis: list[int] = []  # per cut: acknowledged, not stored when the server died (the AOF kept them)
    try:
        for cut in range(CUTS):
            assert durability.check(handle.redis).appendfsync == "always"
            for i in range(cut * PER_CUT, (cut + 1) * PER_CUT):
                ev = Rating(target=f"c{i}", value=1 if i % 3 else -1)
                enqueue_event(handle, ev)  # returned: acknowledged
                acked.append(ev.event_id)
            old = _cut(emb)  # right after the last acknowledgement
            only_in_redis.append(len(set(acked) - set(stored_counts(cfg.db_url))))
            emb.acquire()  # starts the server again on the same files, as any rlfleet process would
            assert emb._server_pid() != old
            if proc is None:  # from the second cut on, a drain is at work when the server dies
                proc = worker("events", env_for(cfg.home), log)
            _wait_stored(cfg.db_url, acked, proc, log, handle)
        assert durability.check(handle.redis).appendfsync == "always"
    finally:
        stop(proc)
        handle.close()
    found = stored_counts(cfg.db_url)
    print(f"\nchaos/embedded redis: {CUTS} SIGKILLs right after acknowledgements, {len(acked)} acknowledged, "
          f"of them only in Redis when it died: {only_in_redis}, {len(found)} stored, "
          f"{sum(n - 1 for n in found.values())} doubled")
    assert only_in_redis[0] == PER_CUT  # no worker yet: the AOF alone kept every one of them
    assert set(found) == set(acked)
    assert all(n == 1 for n in found.values())  # exactly once


def _wait_stored(db_url: str, acked: list[str], proc, log, handle) -> None:
    deadline = time.monotonic() + 60
    while missing := set(acked) - set(stored_counts(db_url)):
        assert time.monotonic() < deadline, (
            f"{len(missing)} acknowledged ratings not stored, {handle.waiting_events()} events waiting\n{tail(log)}")
        assert proc.poll() is None, f"the worker died after a Redis outage\n{tail(log)}"
        time.sleep(0.05)
