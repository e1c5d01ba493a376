"""The process's database engines: one per URL (and one whose commits do not wait for the disk: see
shared/dbsync.py), the pooled-connection ping after a pause, and the schema's migrations."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError

from . import dbsync
from .errors import ConfigError

MIGRATIONS = Path(__file__).with_name("migrations")
_ENGINES: dict[str, Engine] = {}
_DEFERRED_ENGINES: dict[str, Engine] = {}
_MIGRATED: set[str] = set()  # URLs brought to head by this process: once is enough
PING_AFTER_IDLE_S = 1.0


def engine_for(url: str, deferred: bool = False) -> Engine:
    """The process's engine for ``url``; ``deferred``: a second one whose commits do not wait for the
    disk (shared/dbsync.py)."""
    engines = _DEFERRED_ENGINES if deferred else _ENGINES
    if url in engines:
        return engines[url]
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        engine = create_engine(url, future=True, connect_args=dbsync.connect_args(url, deferred))
    except Exception as exc:  # bad URL or missing driver: one line with the fix
        raise ConfigError(f"cannot use DATABASE_URL: {exc}") from None
    _ping_when_idle(engine)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # WAL lets readers (status) run beside the writer (worker)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=10000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA synchronous={dbsync.sqlite_synchronous(deferred)}")
            cur.close()

    engines[url] = engine
    return engine


def forget(url: str) -> None:
    """Close this process's engines for ``url`` (a database about to be dropped)."""
    _MIGRATED.discard(url)
    for engines in (_ENGINES, _DEFERRED_ENGINES):
        engine = engines.pop(url, None)
        if engine is not None:
            engine.dispose()


def _ping_when_idle(engine: Engine) -> None:
    """``pool_pre_ping``, for connections idle a while only: a drain busy with batches would otherwise
    pay a round trip per transaction. A connection the server dropped (a restart) is found by the ping
    on its first use after the pause and replaced; one dropped mid-stream fails that transaction,
    which the drain treats as the database being down, as for any outage, and the pool reconnects."""

    @event.listens_for(engine, "checkin")
    def _used(_dbapi_conn, record) -> None:
        record.info["returned"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn, record, _proxy) -> None:
        if time.monotonic() - record.info.get("returned", float("-inf")) < PING_AFTER_IDLE_S:
            return
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception:
            alive = False
        if not alive:
            raise DisconnectionError("the pooled connection is gone")  # the pool discards it and reconnects


def migrate(engine: Engine) -> None:
    from alembic import command
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # Processes start together (chat, its workers, a CLI command): one migrates, the others wait
    # and then find the schema at head. SQLite runs each DDL statement in its own transaction, so
    # without the lock two of them interleave ("table ... already exists").
    with _migration_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7155172026)")
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    db = engine.url.database if engine.dialect.name == "sqlite" else None
    if not db or db == ":memory:":
        yield
        return
    import fcntl

    with open(f"{db}.migrate-lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
