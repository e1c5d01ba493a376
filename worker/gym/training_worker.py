"""The training worker an environment agent starts for ``background=True`` when none serves its data
dir's queue: ``python -m rlfleet.worker --queue train`` as a child of the agent's process, on its
data dir, logging to ``<home>/logs/worker-train.log``.

One that dies is started again when the agent next looks (its recovery fails the run it died in, which
the agent raises), by the fleet's rule (:class:`rlfleet.shared.lifecycle.RestartPolicy`): quick deaths
in a row wait longer each time, and after too many the agent raises with the log's path instead.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from rlfleet.shared.errors import RlfleetError
from rlfleet.shared.lifecycle import RestartPolicy, spawn_child

ARGV = ["rlfleet.worker", "--queue", "train"]


class WorkerGaveUp(RlfleetError):
    """The agent's training worker kept dying right after starting."""


class ChildWorker:
    def __init__(self, home: Path, policy: RestartPolicy | None = None) -> None:
        self.log_path = home / "logs" / "worker-train.log"
        self._home = home
        self.policy = policy or RestartPolicy()
        self.quick_deaths = 0
        self.restarts = 0
        self._due: float | None = None  # when a dead worker is started again
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        self.started = time.monotonic()
        return spawn_child(ARGV, self._home, self.log_path)

    def check(self) -> None:
        """Start the worker again if it died and is due; :class:`WorkerGaveUp` after quick deaths in a row."""
        code = self.proc.poll()
        if code is None:
            return
        now = time.monotonic()
        if self._due is None:  # newly found dead
            quick = now - self.started < self.policy.healthy_after
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            wait = self.policy.delay(self.quick_deaths)
            if wait is None:
                raise WorkerGaveUp(f"the training worker this agent started exited {self.quick_deaths} times in a "
                                   f"row right after starting (last exit code {code}): see {self.log_path}")
            self._due = now + wait
        if now >= self._due:
            self.proc, self._due = self._start(), None
            self.restarts += 1

    def stop(self, grace: float = 10.0, now: bool = False) -> None:
        """SIGTERM (RQ finishes a job in hand, none is left when the agent closes), then SIGKILL after
        ``grace`` seconds. ``now``: a second SIGTERM right after the first, RQ's stop that ends the
        job in hand too (the run is then failed as interrupted, its episodes kept)."""
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        if now:
            try:
                self.proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
