"""What an acknowledgement is worth on the Redis in use: the embedded server fsyncs before it replies,
and `rlfleet status` warns (human and --json) when an external REDIS_URL cannot keep the promise, or
says it could not check when the server refuses CONFIG. Each case runs its own real redis-server on a
unix socket with the settings under test (the machine's shared server is never reconfigured)."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis
from typer.testing import CliRunner

from rlfleet.cli.app import app
from rlfleet.shared import durability
from rlfleet.shared.embedded_redis import EmbeddedRedis, redis_server_binary


@pytest.fixture
def server(tmp_path) -> Iterator:
    """Start a redis-server with the given extra arguments; its ``unix://`` URL. Killed in teardown."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> str:
        sock = tmp_path / f"r{len(procs)}.sock"
        procs.append(subprocess.Popen(
            [redis_server_binary(), "--port", "0", "--unixsocket", str(sock), "--dir", str(tmp_path),
             "--save", "", "--appendfilename", f"r{len(procs)}.aof", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        url = f"unix://{sock}"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                return url
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def test_the_embedded_server_fsyncs_before_it_acknowledges(tmp_path):
    emb = EmbeddedRedis(tmp_path)
    try:
        d = durability.check(emb.acquire())
    finally:
        emb.release()
    assert (d.ok, d.appendonly, d.appendfsync, d.warning) == (True, "yes", "always", None)


def test_attaching_to_a_running_everysec_server_makes_it_fsync_always(tmp_path):
    first = EmbeddedRedis(tmp_path)
    conn = first.acquire()
    try:
        conn.config_set("appendfsync", "everysec")  # as a server started by an earlier rlfleet runs
        second = EmbeddedRedis(tmp_path)
        second.acquire()
        assert durability.check(conn).appendfsync == "always"
        second.release()
    finally:
        first.release()


@pytest.mark.parametrize(("args", "ok", "says"), [
    (("--appendonly", "yes", "--appendfsync", "always"), True, None),
    (("--appendonly", "yes", "--appendfsync", "everysec"), False, "appendfsync everysec"),
    (("--appendonly", "yes", "--appendfsync", "no"), False, "appendfsync no"),
    (("--appendonly", "no"), False, "appendonly no"),
    (("--appendonly", "yes", "--rename-command", "CONFIG", ""), None, "could not check"),
])
def test_status_says_what_an_external_redis_can_promise(server, queued_home, monkeypatch, args, ok, says):
    monkeypatch.setenv("REDIS_URL", server(*args))
    runner = CliRunner()
    res = runner.invoke(app, ["status", "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)["durability"]
    assert d["ok"] is ok
    human = runner.invoke(app, ["status"], catch_exceptions=False)
    assert human.exit_code == 0, human.output
    if says is None:
        assert d["warning"] is None and "durability" not in human.output
    else:
        assert says in d["warning"] and "appendonly yes and appendfsync always" in d["warning"]
        assert says in " ".join(human.output.split())  # rich may wrap the line
