"""The process's one compute thread (shared/compute_thread.py): whichever thread asks, the work runs
there, in order, and what it returns or raises comes back to the caller."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlfleet.shared.compute_thread import ComputeThread


def test_work_from_any_thread_runs_on_one_thread_of_its_own_in_order():
    compute = ComputeThread("test-compute")
    seen: list[tuple[int, int]] = []

    def ask(i: int) -> int:
        return compute.run(lambda: seen.append((i, threading.get_ident())) or i * i)

    with ThreadPoolExecutor(4) as callers:
        assert list(callers.map(ask, range(12))) == [i * i for i in range(12)]
    assert ask(12) == 144  # and from the test's own thread
    threads = {ident for _, ident in seen}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert sorted(i for i, _ in seen) == list(range(13))


def test_what_the_work_raises_comes_back_and_the_thread_goes_on():
    compute = ComputeThread("test-compute")
    with pytest.raises(KeyError, match="nope"):
        compute.run(lambda: {}["nope"])
    first = compute.run(threading.get_ident)
    with pytest.raises(SystemExit):  # not only Exceptions: the caller decides what they mean
        compute.run(lambda: (_ for _ in ()).throw(SystemExit(3)))
    assert compute.run(threading.get_ident) == first


def test_work_that_asks_for_the_compute_thread_again_runs_at_once():
    compute = ComputeThread("test-compute")
    outer = compute.run(lambda: (threading.get_ident(), compute.run(threading.get_ident)))
    assert outer[0] == outer[1]  # (waiting for itself would never return)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_compute_thread_of_its_own():
    compute = ComputeThread("test-compute")
    parent = compute.run(threading.get_ident)
    pid = os.fork()
    if pid == 0:  # the child: its copy of the parent's thread does not run here
        ok = False
        try:
            ok = compute.run(os.getpid) == os.getpid() and compute.run(threading.get_ident) != threading.get_ident()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert compute.run(threading.get_ident) == parent


class _Stop(BaseException):
    """What a stop signal raises in the waiting caller (RQ raises SystemExit on a second SIGTERM)."""


def test_a_caller_stopped_while_it_waits_stops_the_work_which_cleans_up_first():
    compute = ComputeThread("test-compute")
    events: list[str] = []

    def long_work() -> None:
        try:
            for _ in range(1000):
                time.sleep(0.01)
            events.append("finished")
        finally:
            events.append("cleaned up")

    def stop(_signum, _frame):
        raise _Stop

    before = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        with pytest.raises(_Stop):
            compute.run(long_work)
        assert time.monotonic() - started < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    assert events == ["cleaned up"]  # unwound before the caller went on, not finished
    assert compute.run(lambda: 7) == 7  # the thread works on


def test_the_compute_thread_has_the_torch_threads_of_the_thread_that_started_it():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # The trainer's micro-batch pool gives its threads 1; torch then gives 1 to every thread made later.
        with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            pool.submit(int).result()
        later: list[int] = []
        plain = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        plain.start()
        plain.join()
        assert later == [1]  # (what a thread of its own would compute with)
        compute = ComputeThread("test-compute")
        assert compute.run(torch.get_num_threads) == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_torch_another_thread_is_still_importing_is_waited_for(tmp_path):
    # The training worker's preload imports torch in a thread while its idle work starts on the compute
    # thread, which keeps the caller's torch threads: a half-imported torch has no get_num_threads yet.
    # A stand-in torch that takes a second to import, in a process of its own (the real one is loaded here).
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("import time\ntime.sleep(1.0)\ndef get_num_threads():\n    return 3\n"
                                      "def set_num_threads(n):\n    pass\n")
    code = ("import sys, threading, time\n"
            "from rlfleet.shared.compute_thread import ComputeThread\n"
            "threading.Thread(target=lambda: __import__('torch'), daemon=True).start()\n"
            "while 'torch' not in sys.modules:\n    time.sleep(0.01)\n"
            "print(ComputeThread().run(lambda: 'ran'), sys.modules['torch'].get_num_threads())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "3"]
