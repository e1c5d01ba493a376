"""The one thread of a process that runs its model's compute, whichever thread asks for it.

torch and llama.cpp share one OpenMP runtime in a process: llama.cpp's library asks for
``libgomp.so.1``, and torch's copy, loaded first under that name, serves both. That runtime keeps a
team of threads for every thread that has started a parallel region, for as long as that thread
lives, and once the teams' threads together outnumber the cores it stops spinning at its barriers
and sleeps in the kernel instead. llama.cpp meets a barrier at every node of its graph, so a token
step then costs several times as much: in the training worker, a run's thread and the thread of the
idle work (each with its team) slowed every draw of the runs' (the loop checks', the gate's) on a
2-core CPU (bench/RESULTS.md, "one thread for the compute"). So the threads that take turns with the
model hand their work to one thread (:func:`on_compute_thread`), and a single team serves them all.

What ``fn`` sees on that thread: torch's thread-local state at its defaults (gradients enabled, no
autocast), set by ``fn`` for itself, and as many torch threads as the thread that started it had
(torch gives a new thread the count last set anywhere in the process, and the trainer's micro-batch
pool sets 1 on its own threads); what it raises comes back to the caller. A caller whose wait is
interrupted (a stop signal raising in the main thread) stops the work the same way: the exception is
raised in the compute thread too, so the work unwinds and cleans up as it would have in the caller's
own thread, before the caller goes on. A process that forks gets a thread of its own in the child.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

R = TypeVar("R")

# How long an interrupted caller waits for the work to unwind (a torch kernel running when the
# exception arrives finishes first: the exception is raised at the next line of Python).
UNWIND_WAIT_S = 30.0


class ComputeThread:
    """A daemon thread that runs the functions handed to :meth:`run`, one at a time, in order (a
    daemon: a worker stopped the hard way is not kept alive by a run in progress)."""

    def __init__(self, name: str = "rlfleet-compute") -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], R]) -> R:
        """``fn()`` on the compute thread, waited for; called from that thread itself, it runs at once."""
        if threading.current_thread() is self._thread:
            return fn()
        future, thread = self._submit(fn)
        try:
            return future.result()
        except BaseException as exc:
            if future.done() or future.cancel():  # fn's own exception, or fn never started
                raise
            _raise_in(thread, type(exc))
            with contextlib.suppress(BaseException):
                future.exception(timeout=UNWIND_WAIT_S)
            raise

    def submit(self, fn: Callable[[], R]) -> Future[R]:
        """``fn()`` queued for the compute thread; its future (cancelled before it starts, it never runs)."""
        return self._submit(fn)[0]

    def _submit(self, fn: Callable[[], R]) -> tuple[Future[R], threading.Thread]:
        future: Future[R] = Future()
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()  # (a forked child's copy may hold its parent's)
                self._thread = threading.Thread(target=self._loop, args=(self._jobs, _torch_threads()),
                                                name=self.name, daemon=True)
                self._pid = os.getpid()
                self._thread.start()
            self._jobs.put((fn, future))
            return future, self._thread

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]], torch_threads: int | None) -> None:
        if torch_threads is not None:
            sys.modules["torch"].set_num_threads(torch_threads)
        while True:
            fn, future = jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # the caller raises it in its own thread
                future.set_exception(exc)


def _torch_threads() -> int | None:
    """The calling thread's torch threads, where torch is loaded (None: it is not, and nothing to keep)."""
    if "torch" not in sys.modules:
        return None
    # torch in sys.modules may be half made: another thread may still be importing it (the training
    # worker's preload, while its idle work starts), and a half-made module has no get_num_threads
    # yet. The import statement waits for that thread to finish it.
    import torch

    return int(torch.get_num_threads())


def _raise_in(thread: threading.Thread, exc_type: type[BaseException]) -> None:
    """``exc_type`` raised in ``thread`` at its next line of Python (CPython's asynchronous exception)."""
    if thread.ident is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(exc_type))


_COMPUTE = ComputeThread()


def on_compute_thread(fn: Callable[[], R]) -> R:
    """``fn()`` on this process's compute thread (see the module's docstring), waited for."""
    return _COMPUTE.run(fn)


async def on_compute_thread_async(fn: Callable[[], R]) -> R:
    """``fn()`` on this process's compute thread, awaited: for a server's event loop, in place of
    ``asyncio.to_thread``, whose pool hands calls to whichever of its threads is free. Cancelled before
    it starts, ``fn`` never runs; once started, it runs to its end."""
    return await asyncio.wrap_future(_COMPUTE.submit(fn))
