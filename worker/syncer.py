"""The events drain's database sync, on a thread beside it (see shared/dbsync.py and shared/inbox.py).

The drain commits its batches without waiting for the disk and answers at once; this thread puts
those commits on disk (one sync covers every commit before it) and then lets Redis drop their
events. A sync that fails (the database went away) is tried again; until one succeeds the batches
stay in Redis, and a drain that dies meanwhile leaves them to the next one, which applies them again.
"""

from __future__ import annotations

import logging
import threading

import redis

from rlfleet.shared import inbox
from rlfleet.shared.store import Store

log = logging.getLogger("rlfleet.worker")
RETRY_S = 1.0  # after a failed sync
EVERY_S = 0.05  # at most one sync per this many seconds: each costs a flush; the events wait in Redis


class Syncer:
    """``nudge`` after each unsynced batch; leaving the ``with`` block syncs what is left (and raises if
    it cannot, unless the block is already failing: then the batches are left to the next drain)."""

    def __init__(self, store: Store, conn: redis.Redis) -> None:
        self.store, self.conn = store, conn
        self._work = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlfleet-db-sync", daemon=True)

    def __enter__(self) -> Syncer:
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        self._work.set()
        self._thread.join()
        if exc_type is None:
            self.sync_now()

    def nudge(self) -> None:
        self._work.set()

    def sync_now(self) -> None:
        """What was answered so far is on disk and gone from Redis when this returns."""
        tokens = inbox.unsynced(self.conn)  # read first: a batch answered after this may miss the sync
        if tokens:
            self.store.sync()
            inbox.confirm(self.conn, tokens)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._work.wait()
            if self._stop.wait(EVERY_S):  # the batches of the next moments share this sync
                return
            self._work.clear()
            try:
                self.sync_now()
            except Exception as exc:  # the database or Redis is away: the batches wait in Redis
                log.warning("database sync failed, retrying: %s: %s", type(exc).__name__, exc)
                self._stop.wait(RETRY_S)
                self._work.set()
