"""How an rlfleet process stops: a ``kill`` or a closed terminal unwinds it like Ctrl-C, and a child of
``chat`` or ``up`` stops when the parent that started it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PARENT_ENV = "RLFLEET_PARENT_PID"  # set for background children: they stop when that process is gone


_held = 0  # depth of held_interrupts() blocks in this process
_pending: BaseException | None = None  # what a stop signal that came while they held it raises


def _interrupt(signum: int, _frame: object) -> None:
    _raise_or_hold(KeyboardInterrupt())


def _exit(signum: int, _frame: object) -> None:
    _raise_or_hold(SystemExit(128 + signum))  # the exit status a shell gives a process killed by it


def _raise_or_hold(exc: BaseException) -> None:
    global _pending
    if _held:
        _pending = exc
        return
    raise exc


@contextmanager
def held_interrupts() -> Iterator[None]:
    """Hold the KeyboardInterrupt of a SIGTERM or SIGHUP until the block is done, for the few steps
    that must not be cut in two: a server started but its lease not yet written (or written but its
    release not yet registered) would outlive every process of the data dir. Ctrl-C is not held.
    Only the main thread is held: the interrupt is raised there, never in another thread's block."""
    global _held, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _pending is not None:
            exc, _pending = _pending, None
            raise exc


def interrupt_on_stop_signals() -> None:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, so they unwind like Ctrl-C: workers stopped, the
    embedded Redis released (an orphaned server would outlive us). RQ's own worker installs its own
    handlers while it works."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


def exit_on_stop_signals_by_default() -> None:
    """Where SIGTERM and SIGHUP still do what they do by default (a user's script that uses rlfleet as a
    library, say ``rlfleet.gym``), they exit through ``SystemExit`` instead (status 128 + the signal, as
    the default gives), so ``atexit`` runs: by default Python dies at once and the embedded Redis it
    started would outlive it. A handler the program chose is left alone; only the main thread can
    install one."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit)


def stop_with_parent(poll: float = 2.0, resend: float = 10.0) -> None:
    """In a background child: when the parent that started us dies without stopping us (killed
    with SIGKILL), stop like on SIGTERM (RQ finishes the job in hand) instead of running orphaned.

    While our own handler (:func:`interrupt_on_stop_signals`) still answers SIGTERM, the signal is
    sent again every ``resend`` seconds until the process is gone: its KeyboardInterrupt can land in
    a ``__del__`` or an import's callback that swallows it, and the process would then run on,
    orphaned. Each handler of someone else's that takes over SIGTERM meanwhile (an RQ worker started
    after the stop was swallowed) gets it once: a second SIGTERM to the same RQ worker is its cold
    shutdown, which would kill the job in hand."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not parent.isdigit():
        return

    def owner(handler: object) -> object:
        # RQ swaps its warm-stop handler for its cold-stop one: both are methods of one worker
        return getattr(handler, "__self__", handler)

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(poll)
        told: list[object] = []  # the handlers of someone else's that had their SIGTERM
        sent = float("-inf")
        while True:
            handler = signal.getsignal(signal.SIGTERM)
            now = time.monotonic()
            if handler in (_interrupt, _exit):
                if now - sent >= resend:
                    os.kill(os.getpid(), signal.SIGTERM)
                    sent = now
            elif callable(handler) and not any(owner(handler) is t for t in told):
                told.append(owner(handler))
                os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(min(poll, resend))

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def child_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process of ours on the data dir ``home``."""
    env = dict(os.environ)
    env["RLFLEET_HOME"] = str(home)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def spawn_child(argv: list[str], home: Path, log_path: Path) -> subprocess.Popen:
    """``python -m *argv`` on the data dir ``home`` as a background child of this process, its output
    appended to ``log_path``; it stops when this process is gone (:func:`stop_with_parent`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", *argv],
            env=child_env(home, {PARENT_ENV: str(os.getpid())}),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal reaches the parent, which stops it in order
        )


@dataclass(frozen=True)
class RestartPolicy:
    """When a child that died is started again. A child that lived ``healthy_after`` seconds comes back
    at once (a SIGKILL, an OOM kill); quick deaths in a row wait 1, 2, 4 ... up to ``max_delay``
    seconds; after ``give_up_after`` of them it stays down, shown in red: a bad token or config would
    only crash it again, and a restart loop would bury the first error in its log."""

    healthy_after: float = 30.0
    first_delay: float = 1.0
    max_delay: float = 60.0
    give_up_after: int = 6

    def delay(self, quick_deaths: int) -> float | None:
        """Seconds to wait before the next start; None: stop trying."""
        if quick_deaths >= self.give_up_after:
            return None
        if quick_deaths == 0:
            return 0.0
        return min(self.max_delay, self.first_delay * 2 ** (quick_deaths - 1))
