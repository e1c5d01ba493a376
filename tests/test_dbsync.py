"""A deferred commit's sync on SQLite (shared/dbsync.py) leaves SQLite's own locks alone.

SQLite's locks are POSIX record locks, and closing any descriptor of a file drops every such lock the
process holds on it. A sync that opened and closed the database file to fsync it dropped the shared
lock each open WAL connection keeps: another process closing its connection then took itself for the
last one, checkpointed and deleted the WAL and its shared-memory index under the live connections,
which from then on read a stale database (the workers' new runs never showed up in `rlfleet chat`).
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys

from sqlalchemy import create_engine

from rlfleet.shared import dbsync


def _write_in_another_process(db, value: int) -> None:
    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); c.execute('PRAGMA journal_mode=WAL'); "
            "c.execute('INSERT INTO t VALUES (?)', (int(sys.argv[2]),)); c.commit(); c.close()")
    subprocess.run([sys.executable, "-c", code, str(db), str(value)], check=True, timeout=60)


def test_a_sync_keeps_the_wal_of_a_database_this_process_has_open(tmp_path):
    db = tmp_path / "store.db"
    setup = sqlite3.connect(db)
    setup.execute("PRAGMA journal_mode=WAL")
    setup.execute("CREATE TABLE t (x INTEGER)")
    setup.commit()
    setup.close()
    reader = sqlite3.connect(db)  # open for good, as a pooled connection is
    assert reader.execute("SELECT count(*) FROM t").fetchone() == (0,)
    engine = create_engine(f"sqlite:///{db}")
    try:
        dbsync.sync(engine)
        _write_in_another_process(db, 1)  # its close must not take itself for the last connection
        assert db.with_name("store.db-wal").exists() and db.with_name("store.db-shm").exists()
        dbsync.sync(engine)
        _write_in_another_process(db, 2)
        assert reader.execute("SELECT count(*) FROM t").fetchone() == (2,)  # not a stale snapshot
    finally:
        reader.close()
        engine.dispose()
