"""Micro-batches on threads of their own: how the torch trainer keeps a CPU's cores busy.

A micro-batch of short answers gives each matrix product and attention call too little work to share
well between a CPU's threads, while two micro-batches at once, one thread each, keep both cores busy
(bench/RESULTS.md, "micro-batches side by side"). So a pass over several micro-batches hands them to a
small pool of threads, each with its share of the cores; torch releases the interpreter lock inside
its kernels.

What does not change with the threads: a micro-batch runs whole on one thread, so its values do not
depend on which thread ran it or what ran beside it; the results keep the micro-batches' order; and so
does the accumulated gradient: a micro-batch computed on a pool thread returns its gradient instead
of adding it to ``.grad`` itself, and they are added in the micro-batches' order, so a run repeats
exactly whichever thread finished first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch
from torch import Tensor

T = TypeVar("T")
R = TypeVar("R")


# What a second micro-batch in flight may cost, at least: its activations and temporaries, which the
# allocator keeps for a while after (bench/RESULTS.md, "micro-batches side by side").
MIN_SPARE_BYTES = 4 * 2**30


def auto_workers(device: str, threads: int, spare_bytes: int, model_bytes: int, precision: str) -> int:
    """Micro-batches at once where the setting is left to the trainer: two on a CPU training in bf16
    with two threads or more for torch and the memory to spare (at least 4 GiB available, and twice
    the model's weights), one elsewhere. A GPU runs one stream; in fp32 two micro-batches at once held
    about four times a lone one's memory above the model and gained a few percent at most
    (bench/RESULTS.md, "micro-batches side by side in fp32"), where bf16 held twice and gained a fifth."""
    roomy = spare_bytes >= max(MIN_SPARE_BYTES, 2 * model_bytes)
    return 2 if device == "cpu" and precision == "bf16" and threads >= 2 and roomy else 1


class MicroBatchPool:
    """Runs a function over micro-batches, up to ``workers`` at once, each on a thread with
    ``threads // workers`` of torch's threads; one worker runs them in the caller's thread."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._local = threading.local()

    def resize(self, workers: int) -> None:
        if workers != self.workers:
            self.close()
            self.workers = workers

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is not None and self._pid != os.getpid():
            self._executor = None  # a forked child has none of its parent's threads
        if self._executor is None:
            threads = max(1, torch.get_num_threads() // self.workers)
            self._pid = os.getpid()
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="rlfleet-microbatch",
                                                initializer=torch.set_num_threads, initargs=(threads,))
        return self._executor

    def map(self, fn: Callable[[T], R], items: Sequence[T], params: Sequence[Tensor] = ()) -> list[R]:
        """``[fn(x) for x in items]``; the gradients the calls send to :meth:`backward` are added to
        ``params``' ``.grad`` in ``items``' order. A call that raises stops the rest (those running
        finish first) and the error is raised here."""
        if self.workers < 2 or len(items) < 2:
            return [fn(x) for x in items]
        grad_mode = torch.is_grad_enabled()  # thread-local in torch: the caller's holds in the pool

        def run(x: T) -> tuple[R, list[tuple[Tensor | None, ...]]]:
            self._local.grads = []
            try:
                with torch.set_grad_enabled(grad_mode):
                    return fn(x), self._local.grads
            finally:
                self._local.grads = None

        futures: list[Future] = [self._pool().submit(run, x) for x in items]
        out: list[R] = []
        try:
            for future in futures:
                result, grads = future.result()
                for g in grads:
                    add_grads(params, g)
                out.append(result)
        except BaseException:
            for future in futures:
                future.cancel()
            wait(futures)  # nothing may still run on the model once the caller goes on
            raise
        return out

    def backward(self, loss: Tensor, params: Sequence[Tensor]) -> None:
        """``loss.backward()`` in the caller's thread; on a pool thread the gradient is kept for
        :meth:`map` to add in order."""
        grads = getattr(self._local, "grads", None)
        if grads is None:
            loss.backward()
            return
        grads.append(torch.autograd.grad(loss, list(params), allow_unused=True))


def add_grads(params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Each gradient added to its parameter's ``.grad`` (set where there is none yet), as a backward
    pass would."""
    for p, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad.add_(g)
