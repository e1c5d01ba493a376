"""The fleet ``chat`` and ``up`` run: the events and training workers, and for ``up`` the bots, the
responder and the bridge, as child processes that are started again when they die (see
:class:`RestartPolicy`) and stopped cleanly with their parent."""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.shared.config import Config
from rlfleet.shared.lifecycle import RestartPolicy, spawn_child

log = logging.getLogger("rlfleet.fleet")


@dataclass
class _Child:
    argv: list[str]
    proc: subprocess.Popen
    started: float
    quick_deaths: int = 0
    restarts: int = 0
    due: float | None = None  # when a dead child is started again
    gave_up: bool = False


class BackgroundWorkers:
    """The events and training workers (and, for ``up``, the bots, responder and bridge) as child
    processes, restarted when they die and stopped cleanly with their parent. A restarted worker's
    recovery requeues what the dead one held, so training resumes by itself."""

    def __init__(
        self, cfg: Config, which: tuple[str, ...] = ("events", "train"), bots: tuple[str, ...] = (),
        serve: bool = False, bridge: bool = False, web: bool = False, policy: RestartPolicy | None = None,
        burst: bool = False,
    ) -> None:
        self.cfg = cfg
        self.which = which
        self.bots = bots  # platforms whose bots run beside the workers (`rlfleet bot NAME`)
        self.serve = serve  # `rlfleet serve`, the bots' responder
        self.bridge = bridge  # `rlfleet bridge`, the agents' and gateways' HTTP ingress
        self.web = web  # `rlfleet web`, the browser app (its own model, these workers)
        self.policy = policy or RestartPolicy()
        self.burst = burst  # the workers quit when their queues are empty (`rlfleet train --wait`'s trainer)
        self.children: dict[str, _Child] = {}
        self.log_dir = cfg.home / "logs"
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {name: c.proc for name, c in self.children.items()}

    def start(self, supervise: bool = True) -> None:
        """Start every child; with ``supervise`` a daemon thread restarts the ones that die."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        commands = {name: ["rlfleet.worker", "--queue", name, *(["--burst"] if self.burst else [])]
                    for name in self.which}
        if self.serve:
            commands["serve"] = ["rlfleet.cli", "serve"]
        if self.bridge:
            commands["bridge"] = ["rlfleet.cli", "bridge"]
        if self.web:
            commands["web"] = ["rlfleet.cli", "web", "--no-worker"]
        commands.update({f"bot-{name}": ["rlfleet.cli", "bot", name] for name in self.bots})
        with self._lock:
            for name, argv in commands.items():
                self.children[name] = _Child(argv, self._spawn(name, argv), time.monotonic())
        if supervise:
            self._supervisor = threading.Thread(target=self._supervise_loop, name="rlfleet-supervisor",
                                                daemon=True)
            self._supervisor.start()

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        return spawn_child(argv, self.cfg.home, self.log_path(name))

    def _supervise_loop(self) -> None:
        while not self._stopping.wait(0.5):
            try:
                self.supervise()
            except Exception:  # the supervisor must outlive one failed spawn (a full disk, say)
                log.exception("supervising the workers failed; trying again")

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart the children that died and are due; returns the names started again."""
        restarted: list[str] = []
        with self._lock:
            if self._stopping.is_set():
                return restarted
            now = time.monotonic() if now is None else now
            for name, child in self.children.items():
                if child.gave_up or child.proc.poll() is None:
                    continue
                if child.due is None:  # newly found dead
                    quick = now - child.started < self.policy.healthy_after
                    child.quick_deaths = child.quick_deaths + 1 if quick else 0
                    wait = self.policy.delay(child.quick_deaths)
                    if wait is None:
                        child.gave_up = True
                        log.error("%s exited %d times in a row right after starting (last exit code %s); "
                                  "not restarting it: see %s", name, child.quick_deaths,
                                  child.proc.returncode, self.log_path(name))
                        continue
                    log.warning("%s exited (code %s); restarting it in %.0f s", name, child.proc.returncode, wait)
                    child.due = now + wait
                if now >= child.due:
                    child.proc = self._spawn(name, child.argv)
                    child.started, child.due = now, None
                    child.restarts += 1
                    restarted.append(name)
        return restarted

    def lines(self) -> dict[str, str]:
        """Every child's state in a few words, for ``up``'s panel."""
        out = {}
        for name, child in self.children.items():
            code = child.proc.poll()
            if child.gave_up:
                out[name] = f"stopped after {child.quick_deaths} quick exits (code {code}), not restarted"
            elif code is not None:
                out[name] = f"exited (code {code}), restarting"
            elif child.restarts:
                out[name] = f"restarted {child.restarts}x"
            else:
                out[name] = "running"
        return out

    def state(self) -> dict[str, str]:
        """The children that are not simply running."""
        return {name: line for name, line in self.lines().items() if line != "running"}

    def alive(self) -> dict[str, bool]:
        return {name: c.proc.poll() is None for name, c in self.children.items()}

    def log_path(self, name: str) -> Path:
        return self.log_dir / (f"worker-{name}.log" if name in self.which else f"{name}.log")

    def stop(self, grace: float = 10.0) -> None:
        # First SIGTERM: RQ finishes the job in hand. Second: it stops now (a training run is
        # abandoned, marked failed and re-queued by the next worker's recovery; no rating is lost).
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for p in self.procs.values():
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.children.clear()
        self._stopping.clear()
