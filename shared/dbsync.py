"""When a database commit reaches the disk: at once (the default), or later, at a sync the caller asks for.

The events drain commits its batches without waiting for the disk and answers at once; the batches
stay in Redis's fsynced append-only file (shared/inbox.py, "unsynced") until a sync here has put those
commits on disk, so a power cut that takes the last commits with it finds their events still in Redis,
applied again by the next drain. Waiting for the disk at every commit is what bounded a rating's
latency (a flush per batch of two or three ratings; see bench/RESULTS.md, ``bench.ingest``); one sync
now covers every commit made before it, and it runs beside the drain, not in its way.

Deferred commits go through an engine of their own (``Store.session(durable=False)``), so no
connection that others use ever carries the setting:
- PostgreSQL: its connections run with ``synchronous_commit = off``; a sync is a transaction that
  takes a transaction id and commits synchronously, which flushes the WAL up to its own commit
  record and so every commit before it.
- SQLite (WAL mode): its connections run with ``PRAGMA synchronous=NORMAL`` (a commit is written to
  the WAL, not fsynced); a sync is an fsync of the WAL file (and of the database file, which a
  checkpoint may have written to).
"""

from __future__ import annotations

import os
import threading

from sqlalchemy import Engine

# The database files this process fsyncs, each through one descriptor opened once and never closed:
# SQLite's locks are POSIX record locks, and closing any descriptor of a file drops every lock the
# process holds on it. A connection in WAL mode keeps a shared lock on the database file while it is
# open; without it, another process that closes its connection takes itself for the last one and
# deletes the WAL under ours, which then read a stale database.
_DB_FDS: dict[str, int] = {}
_DB_FDS_LOCK = threading.Lock()


def connect_args(url: str, deferred: bool) -> dict:
    """The driver's connection options for a store engine whose commits wait (or not) for the disk."""
    if deferred and url.startswith("postgresql"):
        return {"options": "-c synchronous_commit=off"}
    return {}


def sqlite_synchronous(deferred: bool) -> str:
    """FULL: a commit is on disk when it returns; NORMAL (in WAL mode): written, fsynced by ``sync``."""
    return "NORMAL" if deferred else "FULL"


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
            _fsync_wal(f"{db}-wal")
            _fsync_database(db)


def _fsync_wal(path: str) -> None:
    # SQLite locks the shared-memory index and the database file, never the WAL: this descriptor
    # may come and go (and a WAL is deleted and made anew, so a kept one would sync a dead file).
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # no WAL: checkpointed and removed, its frames are in the database file
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_database(path: str) -> None:
    with _DB_FDS_LOCK:
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            return
        fd = _DB_FDS.get(path)
        if fd is not None and os.fstat(fd).st_ino != inode:  # a new file at that path: the old one is gone
            os.close(fd)  # (its locks were on the old file: nothing of the new one's is dropped)
            fd = None
        if fd is None:
            fd = _DB_FDS[path] = os.open(path, os.O_RDONLY)
        os.fsync(fd)
