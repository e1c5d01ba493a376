"""The training worker's malloc (shared/allocator.py): "auto" starts a process again, once and in place,
with mimalloc or jemalloc preloaded, and its children get the environment it was started with;
"system" leaves it as it is. mimalloc keeps what a run frees until it is given back: at each
optimizer step and when the trainer falls idle."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from rlfleet.shared import allocator

SCRIPT = """
import os, subprocess, sys
from rlfleet.shared import allocator
print("started", os.getpid(), flush=True)
allocator.preload(sys.argv[1])
child = subprocess.run([sys.executable, "-c", "from rlfleet.shared import allocator; print(allocator.in_use())"],
                       capture_output=True, text=True, check=True).stdout.strip()
print("keep", os.environ.get(allocator.KEEP[0]), flush=True)
print("running", os.getpid(), allocator.in_use(), os.environ.get("LD_PRELOAD"), child, sys.argv[1:], flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    drop = ("LD_PRELOAD", allocator.MARK, allocator.KEEP[0])
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _run(choice: str, **env: str) -> tuple[list[str], list[str], str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, choice, "--an-argument"], env=_env(**env),
                         capture_output=True, text=True, timeout=60, check=True).stdout.splitlines()
    keep = next(line for line in out if line.startswith("keep")).split(" ", 1)[1]
    return [line for line in out if line.startswith("started")], next(
        line for line in out if line.startswith("running")).split(" ", 2), keep


@pytest.mark.skipif(allocator.library() is None, reason="no mimalloc or jemalloc here (not Linux, no train extra)")
def test_auto_starts_the_process_again_with_the_allocator_and_its_children_without_it():
    starts, (_, pid, rest), _keep = _run("auto")
    assert len(starts) == 2 and {s.split()[1] for s in starts} == {pid}  # one exec, in place
    in_use, preload, child, argv = rest.split(" ", 3)
    assert in_use == allocator.kind(allocator.library()) != "system"
    assert preload == "None" and child == "system"  # the environment it was started with, for its children
    assert argv == "['auto', '--an-argument']"  # the same command line


def test_system_leaves_the_process_as_it_started():
    starts, (_, _pid, rest), keep = _run("system")
    assert len(starts) == 1 and rest.split(" ")[0] == "system" and keep == "None"
    assert not allocator.release()  # glibc's malloc: nothing to give back this way


def test_an_unknown_choice_is_refused_before_anything_happens():
    with pytest.raises(ValueError, match="unknown allocator"):
        allocator.preload("tcmalloc-please")


def test_the_kind_of_a_library_is_read_from_its_file_name():
    assert allocator.kind("/x/cmeel.prefix/lib/libmimalloc.so.3") == "mimalloc"
    assert allocator.kind("libjemalloc.so.2") == "jemalloc"
    assert allocator.kind(None) == allocator.kind("/usr/lib/libc.so.6") == "system"


MIMALLOC = allocator.library() is not None and allocator.kind(allocator.library()) == "mimalloc"


@pytest.mark.skipif(not MIMALLOC, reason="no mimalloc here (not Linux, no train extra)")
def test_mimalloc_keeps_a_run_s_freed_blocks_for_an_hour_unless_the_user_says_otherwise():
    _, (_, _, rest), keep = _run("auto")
    assert rest.split(" ")[0] == "mimalloc" and keep == allocator.KEEP[1]
    _, _, keep = _run("auto", **{allocator.KEEP[0]: "7"})
    assert keep == "7"


RELEASE = """
import ctypes, time
from rlfleet.shared import allocator

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

blocks = [bytearray(40 << 20) for _ in range(10)]  # a step's vocabulary-wide tensors are this size
for b in blocks:
    ctypes.memset((ctypes.c_char * len(b)).from_buffer(b), 1, len(b))
before = resident_mib()
del blocks, b
end = time.monotonic() + 2.0  # past mimalloc's own purge delay (1 s), allocating as a process at work does
while time.monotonic() < end:
    junk = [bytearray(n) for n in (100, 5000, 70000, 1 << 20, 3 << 20)]
    del junk
kept = resident_mib()
print(allocator.in_use(), round(before), round(kept), allocator.release(), round(resident_mib()))
"""


@pytest.mark.skipif(not MIMALLOC, reason="no mimalloc here (not Linux, no train extra)")
def test_release_gives_the_freed_blocks_mimalloc_kept_back_to_the_kernel():
    env = _env(LD_PRELOAD=str(allocator.library()), **{allocator.KEEP[0]: allocator.KEEP[1]})
    out = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, timeout=60,
                         check=True).stdout.split()
    in_use, before, kept, released, after = out[0], *map(float, out[1:3]), out[3], float(out[4])
    assert in_use == "mimalloc" and released == "True"
    assert kept > before - 50  # freed, and kept for a next step (mimalloc's own 1 s delay gives them back)
    assert after < kept - 300  # given back


def test_each_optimizer_step_gives_back_what_the_step_before_freed(tiny_trainer, tmp_path, monkeypatch):
    """Within a step a run reuses its freed blocks; what one step freed goes back before the next
    (a run's blocks, of sizes that differ by micro-batch, would pile up over its steps)."""
    from test_trainer import LEARN, preference_samples

    from rlfleet.worker.training import torch_backend

    released: list[int] = []
    monkeypatch.setattr(torch_backend.allocator, "release", lambda: released.append(1) or True)
    cfg = replace(LEARN, steps=3, unlikelihood=0.0)
    tiny_trainer.run(preference_samples()[:4], None, cfg, None, tmp_path / "a")
    assert len(released) == cfg.steps
