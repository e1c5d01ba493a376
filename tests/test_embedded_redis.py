"""The embedded Redis: one real redis-server per data dir, shared by leases, stopped by the last one out.

Each test has its own data dir (tmp_path); every server a test starts is stopped in teardown, killed
if need be, even when the test fails. "Another process" is a real second Python process.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from rlfleet.shared import embedded_redis as er
from rlfleet.shared.embedded_redis import LEASES, EmbeddedRedis
from rlfleet.shared.errors import QueueUnavailable

# A second rlfleet process: acquire, write a key, print the server's pid, then either leave at once
# or hold the lease until told to go (a line on stdin). It never calls release(): atexit must.
CHILD = r"""
import sys
from pathlib import Path
from rlfleet.shared.embedded_redis import EmbeddedRedis
conn = EmbeddedRedis(Path(sys.argv[1])).acquire()
conn.set(sys.argv[2], b"from-child")
print(conn.info("server")["process_id"], flush=True)
if sys.argv[3] == "hold":
    sys.stdin.readline()
"""


def readable(stream, timeout: float) -> bool:
    """Whether ``stream`` has something to read within ``timeout`` seconds (selectors, not select():
    select() refuses a descriptor above 1024, which a long test process may reach)."""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        return bool(sel.select(timeout))


@pytest.fixture
def embedded(tmp_path):
    """Factory for EmbeddedRedis objects; teardown releases them and kills any server left over."""
    made: list[EmbeddedRedis] = []

    def make(home: Path = tmp_path) -> EmbeddedRedis:
        emb = EmbeddedRedis(home)
        made.append(emb)
        return emb

    yield make
    for emb in made:
        try:
            emb.release()
        except Exception:
            pass  # the kill below still runs
    for emb in made:
        pid = emb._server_pid()
        if pid and er.pid_alive(pid) and EmbeddedRedis._is_redis(pid):
            os.kill(pid, signal.SIGKILL)
        if emb.socket_path.parent != emb.dir:
            emb.socket_path.unlink(missing_ok=True)


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []

    def spawn(home: Path, key: str, mode: str) -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(home), key, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        ready = readable(proc.stdout, 15)
        assert ready, "child did not acquire the server in time"
        return proc, int(proc.stdout.readline())

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)


def server_pid(conn: redis.Redis) -> int:
    return int(conn.info("server")["process_id"])


def wait_until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_data_survives_a_full_stop_and_start(tmp_path, embedded):
    emb = embedded()
    assert not EmbeddedRedis.running(tmp_path)
    conn = emb.acquire()
    assert EmbeddedRedis.running(tmp_path)
    assert conn.config_get("appendonly") == {"appendonly": "yes"}
    assert conn.config_get("port") == {"port": "0"}  # a unix socket only
    first = server_pid(conn)
    conn.set("k", "v")

    emb.release()  # the only lease: SHUTDOWN, which fsyncs the AOF
    assert not EmbeddedRedis.running(tmp_path)
    assert not er.pid_alive(first)
    assert not emb.socket_path.exists()
    assert (tmp_path / "redis" / "appendonly.aof").stat().st_size > 0

    conn = emb.acquire()
    assert server_pid(conn) != first
    assert conn.get("k") == b"v"  # bytes, not str: RQ needs them
    assert redis.Redis.from_url(emb.url).get("k") == b"v"  # what RQ workers in subprocesses use
    emb.release()
    emb.release()  # idempotent
    assert not EmbeddedRedis.running(tmp_path)


def test_processes_share_one_server_and_the_last_one_out_stops_it(tmp_path, embedded, children):
    chat = embedded()
    conn = chat.acquire()  # like `rlfleet chat`: starts it
    pid = server_pid(conn)

    # Like `rlfleet status`: attaches to the same server, leaves without stopping it.
    proc, child_pid = children(tmp_path, "status", "exit")
    assert proc.wait(10) == 0
    assert child_pid == pid
    assert conn.get("status") == b"from-child"
    assert EmbeddedRedis.running(tmp_path)
    assert conn.hlen(LEASES) == 1  # the child's lease went with it (atexit)

    # A second object in this process is a second lease on the same server, not a second server.
    other = embedded()
    assert server_pid(other.acquire()) == pid
    other.release()
    assert EmbeddedRedis.running(tmp_path)

    # Like `rlfleet up` still attached when chat exits: the server stays up until it leaves too.
    holder, holder_pid = children(tmp_path, "up", "hold")
    assert holder_pid == pid
    chat.release()
    assert EmbeddedRedis.running(tmp_path)
    assert redis.Redis.from_url(chat.url).get("up") == b"from-child"

    holder.communicate("go\n", timeout=10)  # `up` exits: the last lease, so the server stops
    assert holder.returncode == 0
    assert not EmbeddedRedis.running(tmp_path)
    assert not er.pid_alive(pid)


def test_stale_leases_do_not_keep_the_server_alive(tmp_path, embedded, children):
    emb = embedded()
    conn = emb.acquire()
    pid = server_pid(conn)
    # A process killed with -9 never releases its lease.
    proc, _ = children(tmp_path, "doomed", "hold")
    proc.kill()
    proc.wait(5)
    # A reused pid: alive, but not the process that took the lease (another start time).
    conn.hset(LEASES, f"{os.getppid()}:reused", f"{socket.gethostname()} 1")
    assert conn.hlen(LEASES) == 3

    emb.release()
    assert not EmbeddedRedis.running(tmp_path)
    assert not er.pid_alive(pid)


# A child of `up` told to stop (SIGTERM: its parent is gone) while it starts the server: the signal
# lands after redis-server is up and before the lease is written.
STOPPED_WHILE_STARTING = r"""
import os, signal, sys
from pathlib import Path
from rlfleet.shared.embedded_redis import EmbeddedRedis
from rlfleet.shared.lifecycle import interrupt_on_stop_signals
interrupt_on_stop_signals()
start = EmbeddedRedis._start
def start_then_stop(self):
    start(self)
    self._wait(lambda: self._server_pid() is not None, 10, "the pidfile")
    print(self._server_pid(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
EmbeddedRedis._start = start_then_stop
try:
    EmbeddedRedis(Path(sys.argv[1])).acquire()
    print("not interrupted", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_stop_signal_while_starting_leaves_no_server(tmp_path, embedded):
    """The stop waits until the lease and its release are in place, then unwinds through that
    release: the server this process started does not outlive it."""
    embedded()  # for the fixture's teardown: kills a leftover server
    out = subprocess.run([sys.executable, "-c", STOPPED_WHILE_STARTING, str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    said = out.stdout.split()
    assert said[-1:] == ["interrupted"] and len(said) == 2, out.stdout + out.stderr
    server = int(said[0])  # the child did start one
    assert not EmbeddedRedis.running(tmp_path), "the server outlived the process that started it"
    assert not er.pid_alive(server)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_kill_of_a_process_that_chose_no_handler_stops_its_server(tmp_path, embedded, children, sig):
    """A script that uses rlfleet as a library (``rlfleet.gym``) says nothing about SIGTERM: by default
    Python would die at once, past atexit, and the server it started would run on with nobody left.
    The kill exits through SystemExit instead (the status a shell expects), and the last lease out
    stops the server, its data kept."""
    proc, pid = children(tmp_path, "before-kill", "hold")
    proc.send_signal(sig)
    assert proc.wait(15) == 128 + sig
    wait_until(lambda: not er.pid_alive(pid), 10)
    assert not EmbeddedRedis.running(tmp_path), "the server outlived the process that started it"
    conn = embedded().acquire()
    assert conn.get("before-kill") == b"from-child"
    assert conn.hlen(LEASES) == 1  # ours: the killed process's lease went with it


def test_a_crashed_server_is_restarted_with_its_data(tmp_path, embedded):
    emb = embedded()
    conn = emb.acquire()
    conn.set("survivor", "yes")
    conn.bgrewriteaof()  # on disk now, not just within the next everysec fsync
    wait_until(
        lambda: (
            conn.info("persistence")["aof_rewrite_in_progress"] == 0
            and conn.info("persistence")["aof_rewrite_scheduled"] == 0
        )
    )
    pid = server_pid(conn)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not er.pid_alive(pid))
    assert emb.socket_path.exists() and emb.pidfile.exists()  # what a crash leaves behind
    assert not EmbeddedRedis.running(tmp_path)

    other = embedded()
    conn2 = other.acquire()
    assert server_pid(conn2) != pid
    assert conn2.get("survivor") == b"yes"
    assert conn.get("survivor") == b"yes"  # the old client reconnects to the new server

    emb.release()
    assert EmbeddedRedis.running(tmp_path)  # `other` still holds a lease
    other.release()
    assert not EmbeddedRedis.running(tmp_path)


def test_racing_starters_start_one_server(tmp_path, embedded):
    embedded()  # for its teardown: the server is killed even if this test fails
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tmp_path), f"k{i}", "hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    try:
        pids = set()
        for p in procs:  # all started at once, all holding: they race for the start
            assert readable(p.stdout, 15), "a child did not acquire in time"
            pids.add(int(p.stdout.readline()))
        assert len(pids) == 1
        for p in procs:
            p.communicate("go\n", timeout=10)
        assert not EmbeddedRedis.running(tmp_path)  # each left; the last one out stopped it
        assert not er.pid_alive(pids.pop())
    finally:
        for p in procs:
            p.kill()
            p.wait(5)


def test_a_server_whose_socket_vanished_is_replaced_not_doubled(tmp_path, embedded):
    emb = embedded()
    conn = emb.acquire()
    conn.set("k", "v")
    old = server_pid(conn)
    emb.socket_path.unlink()  # e.g. a /tmp cleaner: the server runs on, unreachable

    conn2 = embedded().acquire()
    assert not er.pid_alive(old)  # stopped (SIGTERM, clean) before a new one opened the AOF
    assert server_pid(conn2) != old
    assert conn2.get("k") == b"v"


def test_long_data_dir_uses_a_short_socket_path(tmp_path, embedded, children):
    home = tmp_path / ("a long dir " + "x" * 60) / ("y" * 60)  # a space, to exercise the URL quoting
    emb = embedded(home)
    assert len(str(home / "redis" / "redis.sock")) > 107
    assert len(str(emb.socket_path)) <= er.MAX_SOCKET_PATH
    assert emb.socket_path == EmbeddedRedis(home).socket_path  # every process derives the same one

    conn = emb.acquire()
    assert (home / "redis" / "socket").read_text().strip() == str(emb.socket_path)
    conn.set("k", "v")
    assert redis.Redis.from_url(emb.url).get("k") == b"v"
    proc, child_pid = children(home, "child", "exit")
    assert proc.wait(10) == 0
    assert child_pid == server_pid(conn)

    emb.release()
    assert not EmbeddedRedis.running(home)
    assert not emb.socket_path.exists()


def test_a_server_that_cannot_start_is_a_clear_error(tmp_path, embedded):
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "appendonly.aof").write_bytes(b"*3\r\n$3\r\nSET\r\ngarbage\r\n")
    with pytest.raises(QueueUnavailable, match=r"append only file.*redis\.log"):
        embedded().acquire()


def test_no_redis_server_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(er.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(er.shutil, "which", lambda name: None)
    with pytest.raises(QueueUnavailable, match="redis-server"):
        er.redis_server_binary()
