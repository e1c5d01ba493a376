"""When a database commit reaches the disk: at once (the default), or later, at a sync the caller asks for.

The events drain commits its batches without waiting for the disk and answers at once; the batches
stay in Redis's fsynced append-only file (shared/inbox.py, "unsynced") until a sync here has put those
commits on disk, so a power cut that takes the last commits with it finds their events still in Redis,
applied again by the next drain. Waiting for the disk at every commit is what bounded a rating's
latency (a flush per batch of two or three ratings; see bench/RESULTS.md, ``bench.ingest``); one sync
now covers every commit made before it, and it runs beside the drain, not in its way.

- PostgreSQL: ``synchronous_commit = off`` for the deferred transaction only (``SET LOCAL``); a sync is
  a transaction that takes a transaction id and commits synchronously, which flushes the WAL up to its
  own commit record and so every commit before it.
- SQLite (WAL mode): ``PRAGMA synchronous=NORMAL`` for the deferred transaction (a commit is written
  to the WAL, not fsynced), set back to FULL when the connection goes back to the pool; a sync is an
  fsync of the WAL file (and of the database file, which a checkpoint may have written to).
"""

from __future__ import annotations

import os

from sqlalchemy import Engine, event
from sqlalchemy.orm import Session

_DEFERRED = "rlfleet_sync_deferred"  # connection-record flag: set back to FULL at check-in


def watch_sqlite_pool(engine: Engine) -> None:
    """A pooled SQLite connection that ran a deferred commit is FULL again before anyone else uses it."""

    @event.listens_for(engine, "checkin")
    def _full_again(dbapi_conn, record) -> None:
        if record.info.pop(_DEFERRED, False) and dbapi_conn is not None:
            dbapi_conn.execute("PRAGMA synchronous=FULL")


def defer(s: Session) -> None:
    """This transaction's commit returns without waiting for the disk (call before it writes)."""
    conn = s.connection()
    dialect = conn.dialect.name
    if dialect == "postgresql":
        conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
    elif dialect == "sqlite":
        conn.connection.info[_DEFERRED] = True
        conn.exec_driver_sql("PRAGMA synchronous=NORMAL")


def sync(engine: Engine) -> None:
    """Every commit this process's store made before this call is on disk when it returns."""
    dialect = engine.dialect.name
    if dialect == "postgresql":
        with engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL synchronous_commit = on")
            conn.exec_driver_sql("SELECT txid_current()")  # an id: the commit writes a record and waits
    elif dialect == "sqlite":
        db = engine.url.database
        if db and db != ":memory:":
            for path in (f"{db}-wal", db):
                _fsync(path)


def _fsync(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # no WAL: checkpointed and removed, its frames are in the database file
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
