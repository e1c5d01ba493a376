"""How a stop signal unwinds an rlfleet process (shared/lifecycle.py): held through the steps that
must not be cut in two, then raised."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from rlfleet.shared import lifecycle


@pytest.fixture
def stop_signals():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    lifecycle.interrupt_on_stop_signals()
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_stop_signal_is_held_until_the_block_ends_then_raised(stop_signals):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with lifecycle.held_interrupts():
            os.kill(os.getpid(), signal.SIGTERM)
            with lifecycle.held_interrupts():  # nested: still held when the inner block ends
                done.append("inner")
            done.append("outer")  # the block ran to its end
    assert done == ["inner", "outer"]
    with pytest.raises(KeyboardInterrupt):  # nothing pending is left over: the next one raises at once
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass


def test_without_a_signal_the_block_raises_nothing(stop_signals):
    with lifecycle.held_interrupts():
        value = 1
    assert value == 1


def test_another_threads_block_holds_nothing(stop_signals):
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with lifecycle.held_interrupts():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        entered.wait(10)
        with pytest.raises(KeyboardInterrupt):  # the main thread is not held by another thread's block
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):
                pass
    finally:
        release.set()
        t.join(10)


# A child whose parent is gone (PARENT_ENV names a pid that is not its parent) and whose first stop
# is swallowed, as a KeyboardInterrupt raised inside a __del__ is.
SWALLOWED = r"""
import signal, sys, time
from rlfleet.shared import lifecycle
class Worker:  # RQ's: the first SIGTERM asks for a warm stop and makes a second one its cold stop
    got = []
    def request_stop(self, *_):
        self.got.append("warm")
        signal.signal(signal.SIGTERM, self.request_force_stop)
    def request_force_stop(self, *_):
        self.got.append("cold")
if sys.argv[1] in ("ours", "swap"):
    lifecycle.interrupt_on_stop_signals()
else:  # a handler of someone else's (an RQ worker's warm shutdown): counts and carries on
    signal.signal(signal.SIGTERM, Worker().request_stop)
try:
    lifecycle.stop_with_parent(poll=0.05, resend=0.5)
    time.sleep(30 if sys.argv[1] == "ours" else 5)
except KeyboardInterrupt:
    print("swallowed", flush=True)
if sys.argv[1] == "swap":  # still importing when the stop came: RQ's worker starts after it was swallowed
    signal.signal(signal.SIGTERM, Worker().request_stop)
    time.sleep(5)
if sys.argv[1] != "ours":
    print(f"signals {Worker.got}", flush=True)
    sys.exit(0)
try:
    time.sleep(30)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def _orphan(kind: str, timeout: float) -> str:
    env = {**os.environ, lifecycle.PARENT_ENV: str(os.getpid() + 999_999)}  # never our parent's pid
    out = subprocess.run([sys.executable, "-c", SWALLOWED, kind], env=env, capture_output=True, text=True,
                         timeout=timeout)
    return out.stdout + out.stderr


def test_an_orphan_whose_first_stop_was_swallowed_is_stopped_again():
    said = _orphan("ours", 20)
    assert "swallowed" in said and "stopped" in said, said


def test_someone_elses_handler_gets_the_stop_once():
    said = _orphan("rq", 30)  # its handler does not raise: the 5 s sleep runs out, ten resends' worth
    assert "signals ['warm']" in said, said


def test_a_worker_started_after_the_stop_was_swallowed_gets_it_once():
    """The stop reached our handler while the worker still imported and was swallowed there; RQ's
    worker then took over SIGTERM: it must get its warm stop (else it runs on, orphaned), and only one."""
    said = _orphan("swap", 30)
    assert "swallowed" in said and "signals ['warm']" in said, said


# A script that uses rlfleet as a library: it may have chosen a SIGTERM handler of its own, or not.
LIBRARY_USER = r"""
import atexit, os, signal, sys, time
from rlfleet.shared import lifecycle
atexit.register(lambda: print("atexit ran", flush=True))
if sys.argv[1] == "own":
    signal.signal(signal.SIGTERM, lambda *_: (print("own handler", flush=True), os._exit(7)))
lifecycle.exit_on_stop_signals_by_default()
if sys.argv[1] == "held":
    with lifecycle.held_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        print("block finished", flush=True)
    print("after the block", flush=True)
else:
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
print("not stopped", flush=True)
"""


def _library_user(kind: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LIBRARY_USER, kind], capture_output=True, text=True, timeout=30)


def test_a_process_that_chose_no_handler_exits_on_a_stop_signal_through_atexit():
    out = _library_user("default")
    assert out.returncode == 128 + signal.SIGTERM, out.stdout + out.stderr
    assert out.stdout.split("\n")[:1] == ["atexit ran"], out.stdout
    assert "Traceback" not in out.stderr  # SystemExit: a quiet exit, not an error


def test_the_exit_waits_for_a_held_block():
    out = _library_user("held")
    assert out.returncode == 128 + signal.SIGTERM, out.stdout + out.stderr
    assert out.stdout.split() == ["block", "finished", "atexit", "ran"], out.stdout


def test_a_handler_the_program_chose_is_left_alone():
    out = _library_user("own")
    assert out.returncode == 7 and out.stdout.split("\n")[:1] == ["own handler"], out.stdout + out.stderr
