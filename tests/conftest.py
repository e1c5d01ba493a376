"""Shared fixtures: a fresh data dir, a real Redis (the machine's, or an embedded one), real databases.

Each test gets its own Redis DB number flushed before use and its own data dir, so tests run in
any order. PostgreSQL legs are skipped with a visible reason only when no server answers.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))  # tinymodel.py
sys.path.insert(0, str(Path(__file__).parents[1]))  # the repository root: bench/

PG_ADMIN_URL = os.environ.get("RLFLEET_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_BASE = os.environ.get("RLFLEET_TEST_REDIS", "redis://127.0.0.1:6379")
# A DB number of our own on the shared server, flushed per test. The suite runs in pytest-xdist workers
# (pyproject's addopts): worker gwN takes the base number + N, so a run side by side with this one
# needs a base number at least the worker count away.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
TEST_DB = int(os.environ.get("RLFLEET_TEST_REDIS_DB", "13")) + _WORKER

# Workers each using every core fight over them (torch's threads spin while they wait): each worker,
# and each process a test starts, gets its share of the cores unless the caller chose a number.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))


# What each heavier file costs, in seconds of test time in one suite run (three workers on a 2-core VM;
# refresh from `--junitxml`): xdist hands out whole files (pyproject's `--dist loadfile`) in collection
# order, so the long ones start first and the short ones fill the end. xdist's own order, by number of
# tests, started a one-test chaos file and the type check last, and the run waited on them alone.
FILE_COST = {
    "test_bench_systems.py": 143, "test_spine.py": 122, "test_cli.py": 102, "test_mlx_trainer.py": 88,
    "test_llamacpp_engine.py": 86, "test_web.py": 77, "test_bench_learning.py": 70, "test_gym.py": 66,
    "test_bot_permissions.py": 67, "test_default_model.py": 60, "test_gate_runs.py": 59,
    "test_bot_outages.py": 58, "chaos/test_kill_trainer.py": 54, "test_serve.py": 52,
    "fuzz/test_hostile_cli.py": 45, "test_idle_work.py": 43, "test_bot_slack.py": 41, "test_scopes.py": 40,
    "test_types.py": 37, "test_chat.py": 37, "fuzz/test_hostile_input.py": 34, "test_serving_gguf.py": 22,
    "chaos/test_supervised.py": 22, "test_replay.py": 21, "test_inbox.py": 21, "test_bot_telegram.py": 21,
    "test_export.py": 20, "test_bot_teams.py": 19, "test_bot_discord.py": 19, "test_hooks.py": 19,
    "chaos/test_restart_redis.py": 16, "fuzz/test_hostile_teams.py": 16, "chaos/test_kill_bridge.py": 16,
    "test_bench_ingest.py": 15, "test_bridge.py": 13, "test_trainer.py": 13, "chaos/test_kill_workers.py": 10,
}
_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heaviest files first (stable: a file's tests keep their order, the rest theirs)."""
    def cost(item: pytest.Item) -> int:
        try:
            name = item.path.relative_to(_TESTS).as_posix()
        except ValueError:
            return 0
        return FILE_COST.get(name, 0)

    items.sort(key=lambda item: -cost(item))


def _redis_up(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """The machine's Redis if it answers, else an embedded server for the whole session."""
    url = f"{REDIS_BASE}/{TEST_DB}"
    if _redis_up(url):
        yield url
        return
    from rlfleet.shared.embedded_redis import EmbeddedRedis

    emb = EmbeddedRedis(tmp_path_factory.mktemp("redis-home"))
    emb.acquire()
    try:
        yield emb.url
    finally:
        emb.release()


@pytest.fixture
def rconn(redis_url) -> redis.Redis:
    conn = redis.Redis.from_url(redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A fresh data dir; env as a new user has it (no REDIS_URL unless a test sets one)."""
    h = tmp_path / "rlfleet-home"
    h.mkdir()
    monkeypatch.setenv("RLFLEET_HOME", str(h))
    for var in ("REDIS_URL", "DATABASE_URL", "RLFLEET_MODEL", "RLFLEET_THRESHOLD", "RLFLEET_PRESET"):
        monkeypatch.delenv(var, raising=False)
    import rlfleet.worker.context as worker_context

    monkeypatch.setattr(worker_context, "_CTX", None)
    return h


@pytest.fixture
def private_tempdir(monkeypatch) -> Iterator[Path]:
    """tempfile's folder for this test alone, to check that the code under test removes what it puts
    there (short: an embedded Redis keeps its socket under it)."""
    folder = Path(tempfile.mkdtemp(prefix="rlt-"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def queued_home(home, rconn, redis_url, monkeypatch) -> Path:
    """A data dir wired to the test Redis through REDIS_URL."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    return home


def _pg_available() -> bool:
    try:
        import sqlalchemy as sa

        eng = sa.create_engine(PG_ADMIN_URL, connect_args={"connect_timeout": 2})
        with eng.connect():
            pass
        eng.dispose()
        return True
    except Exception:
        return False


@pytest.fixture
def pg_admin_url() -> str:
    """A PostgreSQL URL allowed to create databases (the test is skipped when none answers)."""
    if not _pg_available():
        pytest.skip(f"no PostgreSQL answers at {PG_ADMIN_URL}")
    return PG_ADMIN_URL


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rlfleet.db'}"
        return
    if not _pg_available():
        pytest.skip(f"no PostgreSQL answers at {PG_ADMIN_URL}")
    from bench.ingest import fresh_database

    with fresh_database(PG_ADMIN_URL, prefix="rlfleet_t_") as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    from tinymodel import one_torch_thread

    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tiny_trainer(tiny_model_dir, single_thread):
    """The torch trainer on the tiny model, shared by a module's tests (importing peft costs seconds)."""
    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.training.torch_backend import Trainer

    return Trainer(resolve_model(str(tiny_model_dir)))
