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
if sys.argv[1] == "ours":
    lifecycle.interrupt_on_stop_signals()
else:  # a handler of someone else's (an RQ worker's warm shutdown): counts and carries on
    got = []
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))
try:
    lifecycle.stop_with_parent(poll=0.05, resend=0.5)
    time.sleep(30 if sys.argv[1] == "ours" else 5)
except KeyboardInterrupt:
    print("swallowed", flush=True)
if sys.argv[1] != "ours":
    print(f"signals {len(got)}", flush=True)
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
    assert "signals 1" in said, said
