"""Which ``malloc`` a training worker runs with: mimalloc (or jemalloc) where one is at hand, on Linux.

A CPU training step allocates and frees tensors of tens of megabytes many times over (the output
head's vocabulary-wide rows: 200-340 answer tokens × 49,152 logits in fp32 on the default model).
glibc's ``malloc`` hands such blocks back to the kernel on every ``free`` (``mmap``/``munmap`` past its
threshold, which it caps at 32 MB, and from the per-thread arenas a step's micro-batches run on), so
every new one costs a page fault per 4 KB page before the product can write it. mimalloc and jemalloc
keep freed pages for the next request. The step's peak memory is lower and, the more of its time
such tensors take (long answers), the faster it runs (bench/RESULTS.md, ``bench.train_step``'s
``ours-glibc``).

mimalloc gives a freed block back to the kernel a second after it was freed (its arena's purge delay),
and a step frees and asks again for the same blocks every second or so: each purge is a ``madvise``
and every page of the block a fault again at its next use. So the preloaded mimalloc keeps what it
frees for an hour (:data:`KEEP`), and the worker gives it all back at once with :func:`release` at the
start of each optimizer step (the torch trainer's ``begin_step``) and when the trainer falls idle
(``worker/idle_work.py``'s lease): a step reuses its blocks, a run's peak rises by what one step's
unreused blocks hold, and an idle worker holds no more than before (bench/RESULTS.md, 2026-12-07,
twelfth session).

``malloc`` can only be replaced when a process starts (``LD_PRELOAD``), so :func:`preload` starts the
worker again, once, in place (``exec``: same process id, same arguments) with the library preloaded,
and takes ``LD_PRELOAD`` back out of the environment its own children inherit. The library is the
``cmeel-mimalloc`` wheel's (a dependency of the ``train`` extra on Linux), else a system jemalloc or
mimalloc; none found, or anything but Linux, and the worker runs on as it is. ``train.allocator``:
``"auto"`` (this), ``"system"`` (never).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Set on the exec, so the restarted process neither execs again nor leaves LD_PRELOAD to its children;
# its value is what LD_PRELOAD was before (restored for them).
MARK = "RLFLEET_ALLOCATOR_PRELOADED"
KNOWN = ("mimalloc", "jemalloc", "tcmalloc")
CHOICES = ("auto", "system")
WHEEL = "cmeel-mimalloc"  # the train extra's mimalloc on Linux
# mimalloc's arena purge delay is its purge_delay (1 s by default) times this: an hour. A user's own
# MIMALLOC_ARENA_PURGE_MULT stands.
KEEP = ("MIMALLOC_ARENA_PURGE_MULT", "3600")


def wheel_library() -> Path | None:
    """The ``cmeel-mimalloc`` wheel's shared library, wherever that wheel is installed (a venv, the
    user's site-packages); None without it."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    libs = sorted(Path(str(dist.locate_file(f))) for f in dist.files or () if f.name.startswith("libmimalloc.so"))
    return next((f for f in libs if f.is_file()), None)


def library() -> str | None:
    """What :func:`preload` would preload here: the wheel's mimalloc, else the system's jemalloc or
    mimalloc (by the name the dynamic linker finds it under); None off Linux or when there is none."""
    if not sys.platform.startswith("linux"):
        return None
    wheel = wheel_library()
    if wheel is not None:
        return str(wheel)
    for name in ("jemalloc", "mimalloc"):
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def _named(text: str) -> str:
    """The first of :data:`KNOWN` whose library ``text`` names, else ``"system"``."""
    return next((name for name in KNOWN if f"lib{name}" in text), "system")


def kind(lib: str | None) -> str:
    """Which of :data:`KNOWN` a library path or name is (``"system"`` for None or none of them)."""
    return "system" if lib is None else _named(Path(lib).name)


def in_use() -> str:
    """The allocator this process runs with: one of :data:`KNOWN` when its library is mapped, else
    ``"system"``."""
    try:
        return _named(Path("/proc/self/maps").read_text(errors="replace"))
    except OSError:
        return "system"


def preload(choice: str = "auto") -> None:
    """Start this process again in place with :func:`library` preloaded (``choice`` "auto") when it
    does not run with one yet; returns only where nothing is to be done or the exec failed (logged).
    Call it first thing in a process entry point: the exec runs the same command line from the start."""
    if choice not in CHOICES:
        raise ValueError(f"unknown allocator {choice!r}: {' or '.join(CHOICES)}")
    if MARK in os.environ:  # the restarted process: its children get LD_PRELOAD as it was
        before = os.environ.pop(MARK)
        if before:
            os.environ["LD_PRELOAD"] = before
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    if choice == "system" or in_use() != "system":
        return
    lib = library()
    if lib is None:
        return
    if any(c in lib for c in " :"):  # LD_PRELOAD splits on both: such a path cannot be named in it
        log.warning("not preloading %s: LD_PRELOAD cannot name a path with a space or a colon", lib)
        return
    before = os.environ.get("LD_PRELOAD", "")
    env = {KEEP[0]: KEEP[1], **os.environ, MARK: before, "LD_PRELOAD": f"{lib} {before}".strip()}
    try:
        os.execve(sys.executable, sys.orig_argv, env)
    except OSError as exc:
        log.warning("could not restart with %s preloaded (%s): running with the system allocator", lib, exc)


def release() -> bool:
    """Give what this process's malloc keeps of freed memory back to the kernel now: mimalloc's
    ``mi_collect(true)``, which purges whatever its arenas hold free, whichever thread freed it. False
    (nothing done) where mimalloc is not the process's malloc."""
    collect = _mi_collect()
    if collect is None:
        return False
    collect(True)
    return True


@functools.cache
def _mi_collect() -> Any:
    """mimalloc's ``mi_collect`` in this process, None where mimalloc is not its malloc: looked up once
    (a process's malloc is fixed when it starts, and :func:`release` runs at every optimizer step)."""
    if in_use() != "mimalloc":
        return None
    try:
        collect = ctypes.CDLL(None).mi_collect
    except (OSError, AttributeError):  # mapped but not global (loaded another way than LD_PRELOAD)
        return None
    collect.argtypes, collect.restype = [ctypes.c_bool], None
    return collect
