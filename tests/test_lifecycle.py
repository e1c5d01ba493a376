"""How a stop signal unwinds an rlfleet process (shared/lifecycle.py): held through the steps that
must not be cut in two, then raised."""

from __future__ import annotations

import os
import signal
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
