"""bench/ingest.py end to end, small: real worker processes, every rating stored and timed. Figures
are for bench/RESULTS.md; nothing here asserts a speed."""

from __future__ import annotations

import os

from sqlalchemy import func, select

from bench import ingest
from rlfleet.shared.config import load_config
from rlfleet.shared.embedded_redis import EmbeddedRedis
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.store import Store


def test_every_rating_is_stored_once_and_timed(queued_home, redis_url, monkeypatch, tmp_path, private_tempdir):
    for var in ("RLFLEET_HOME", "REDIS_URL", "RLFLEET_MODEL"):  # run_case points them at its own data dir
        monkeypatch.setenv(var, "unset-by-the-test")
    rows = [ingest.run_case(2, 300, None, redis_url, producers=3),
            ingest.run_case(1, 100, 200.0, redis_url, home=tmp_path / "kept")]
    assert list(private_tempdir.glob("rlfleet-*")) == []  # the temporary data dir went with its case
    for r, n in zip(rows, (300, 100), strict=True):
        assert r["ratings"] == n and r["answered"] == n  # every event's answer was found and timed
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["ratings_per_s"] > 0
        # where the time went: the hand-over and the batch's apply are stamped in order in one process each
        assert 0 < r["p99_ack_ms"] and 0 < r["p99_apply_ms"] <= r["p99_ms"] and "p99_wait_ms" in r
    assert abs(rows[1]["sent_per_s"] - 200) < 40  # the fixed offered rate was kept
    store = Store(load_config().db_url)  # the last case's data dir
    with store.session() as s:
        counts = s.execute(select(RatingRow.event_id, func.count()).group_by(RatingRow.event_id)).all()
    assert len(counts) == 100 and all(n == 1 for _, n in counts)


def test_the_postgres_leg_uses_a_fresh_database_and_drops_it(queued_home, redis_url, pg_admin_url, monkeypatch):
    import contextlib

    import sqlalchemy as sa

    for var in ("RLFLEET_HOME", "REDIS_URL", "RLFLEET_MODEL", "DATABASE_URL"):
        monkeypatch.setenv(var, "unset-by-the-test")
    used: list[str] = []  # this case's database only: other runs may hold databases of their own meanwhile
    fresh = ingest.fresh_database

    @contextlib.contextmanager
    def noting(admin_url: str | None, *args, **kw):
        with fresh(admin_url, *args, **kw) as url:
            used.append(url.rsplit("/", 1)[1])
            yield url

    monkeypatch.setattr(ingest, "fresh_database", noting)
    row = ingest.run_case(1, 200, None, redis_url, pg_admin_url)
    assert row["answered"] == 200 and row["ratings_per_s"] > 0
    assert len(used) == 1 and used[0].startswith("rlfleet_ingest_")
    admin = sa.create_engine(pg_admin_url)
    with admin.connect() as c:
        left = c.execute(sa.text("SELECT datname FROM pg_database WHERE datname = :n"), {"n": used[0]}).all()
    admin.dispose()
    assert left == []


def test_the_embedded_leg_runs_on_its_own_fsyncing_server(monkeypatch):
    for var in ("RLFLEET_HOME", "REDIS_URL", "RLFLEET_MODEL"):
        monkeypatch.setenv(var, "unset-by-the-test")
    row = ingest.run_case(1, 100, None, ingest.EMBEDDED)
    assert row["answered"] == 100 and "REDIS_URL" not in os.environ  # the data dir's own server, not ours
    cfg = load_config()
    assert not EmbeddedRedis.running(cfg.home)  # stopped with the case's last process
    with Store(cfg.db_url).session() as s:
        assert s.scalar(select(func.count()).select_from(RatingRow)) == 100
