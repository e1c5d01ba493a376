"""The training worker's malloc (shared/allocator.py): "auto" starts a process again, once and in place,
with mimalloc or jemalloc preloaded, and its children get the environment it was started with;
"system" leaves it as it is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rlfleet.shared import allocator

SCRIPT = """
import os, subprocess, sys
from rlfleet.shared import allocator
print("started", os.getpid(), flush=True)
allocator.preload(sys.argv[1])
child = subprocess.run([sys.executable, "-c", "from rlfleet.shared import allocator; print(allocator.in_use())"],
                       capture_output=True, text=True, check=True).stdout.strip()
print("running", os.getpid(), allocator.in_use(), os.environ.get("LD_PRELOAD"), child, sys.argv[1:], flush=True)
"""


def _run(choice: str) -> tuple[list[str], list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.MARK)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, choice, "--an-argument"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.splitlines()
    return [line for line in out if line.startswith("started")], next(
        line for line in out if line.startswith("running")).split(" ", 2)


@pytest.mark.skipif(allocator.library() is None, reason="no mimalloc or jemalloc here (not Linux, no train extra)")
def test_auto_starts_the_process_again_with_the_allocator_and_its_children_without_it():
    starts, (_, pid, rest) = _run("auto")
    assert len(starts) == 2 and {s.split()[1] for s in starts} == {pid}  # one exec, in place
    in_use, preload, child, argv = rest.split(" ", 3)
    assert in_use == allocator.kind(allocator.library()) != "system"
    assert preload == "None" and child == "system"  # the environment it was started with, for its children
    assert argv == "['auto', '--an-argument']"  # the same command line


def test_system_leaves_the_process_as_it_started():
    starts, (_, _pid, rest) = _run("system")
    assert len(starts) == 1 and rest.split(" ")[0] == "system"


def test_an_unknown_choice_is_refused_before_anything_happens():
    with pytest.raises(ValueError, match="unknown allocator"):
        allocator.preload("tcmalloc-please")


def test_the_kind_of_a_library_is_read_from_its_file_name():
    assert allocator.kind("/x/cmeel.prefix/lib/libmimalloc.so.3") == "mimalloc"
    assert allocator.kind("libjemalloc.so.2") == "jemalloc"
    assert allocator.kind(None) == allocator.kind("/usr/lib/libc.so.6") == "system"
