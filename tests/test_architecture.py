"""The floor plan holds: which of our packages may import which, read from the source with ``ast``.

    shared   imports nothing of ours (the ground floor)
    bots     -> shared
    bridge   -> shared
    worker   -> shared
    cli      -> anything (rlfleet.cli, the folder worker/cli/: the composition root, that is the
                `rlfleet` command and the process supervisor)

Nobody but cli imports rlfleet.cli, and nobody imports it by its folder's name (rlfleet.worker.cli would
load a second copy of it). Imports inside functions count as much as those at the top.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI_DIR = ROOT / "worker" / "cli"
GYM_DIR = ROOT / "worker" / "gym"  # rlfleet.gym: the environment agent, on top of the worker
FOLDERS = {"shared": ROOT / "shared", "bots": ROOT / "bots", "bridge": ROOT / "bridge", "worker": ROOT / "worker",
           "cli": CLI_DIR, "gym": GYM_DIR}
ALLOWED = {
    "shared": {"shared"},
    "bots": {"bots", "shared"},
    "bridge": {"bridge", "shared"},
    "worker": {"worker", "shared"},
    "cli": {"cli", "shared", "bots", "bridge", "worker"},
    "gym": {"gym", "shared", "worker"},
}


def layer_of_file(path: Path) -> str:
    if path.is_relative_to(CLI_DIR):
        return "cli"
    return "gym" if path.is_relative_to(GYM_DIR) else path.relative_to(ROOT).parts[0]


def module_name(path: Path) -> str:
    """The dotted name a file is imported under (worker/cli/app.py is rlfleet.cli.app)."""
    layer = layer_of_file(path)
    parts = [p for p in path.relative_to(FOLDERS[layer]).with_suffix("").parts if p != "__init__"]
    return ".".join(["rlfleet", layer, *parts])


def imports_in(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, at any depth, relative ones resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            if node.module is None or base == "rlfleet":  # `from . import spool`: the names are modules
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, base))
    return sorted(found)


def allowed(layer: str, module: str) -> bool:
    # worker/cli/ and worker/gym/ are installed as rlfleet.cli and rlfleet.gym: under a second name a file
    # would be a second module
    if any(module == inner or module.startswith(inner + ".") for inner in ("rlfleet.worker.cli", "rlfleet.worker.gym")):
        return False
    parts = module.split(".")
    if parts[0] != "rlfleet" or len(parts) < 2 or parts[1] not in ALLOWED:
        return True  # not ours
    return parts[1] in ALLOWED[layer]


def sources() -> list[Path]:
    return sorted(p for folder in ("shared", "bots", "bridge", "worker") for p in (ROOT / folder).rglob("*.py"))


def offending_imports() -> list[str]:
    bad = []
    for path in sources():
        layer = layer_of_file(path)
        found = imports_in(path.read_text(encoding="utf-8"), module_name(path), path.name == "__init__.py")
        bad += [f"{path.relative_to(ROOT)}:{line} -> {module}" for line, module in found if not allowed(layer, module)]
    return bad


def test_every_package_imports_only_what_lies_below_it():
    bad = offending_imports()
    assert not bad, "imports against the floor plan (see tests/test_architecture.py):\n" + "\n".join(bad)


def test_the_check_reads_every_package_under_its_import_name():
    assert {layer_of_file(p) for p in sources()} == set(ALLOWED)
    assert module_name(CLI_DIR / "app.py") == "rlfleet.cli.app"
    assert module_name(CLI_DIR / "__init__.py") == "rlfleet.cli"
    assert module_name(ROOT / "worker" / "runner.py") == "rlfleet.worker.runner"


def test_the_check_catches_function_level_and_relative_imports():
    source = (
        "from .training_news import TrainingNews\n"
        "from . import core\n"
        "from rlfleet import worker\n"
        "def f():\n"
        "    from rlfleet.worker.jobs import context\n"
        "    import rlfleet.cli.app\n"
        "    from ..cli import fleet\n"
    )
    found = imports_in(source, "rlfleet.bots.terminal", is_package=False)
    assert found == [(1, "rlfleet.bots.training_news"), (2, "rlfleet.bots.core"), (3, "rlfleet.worker"),
                     (5, "rlfleet.worker.jobs"), (6, "rlfleet.cli.app"), (7, "rlfleet.cli")]
    assert [m for _, m in found if not allowed("bots", m)] == [
        "rlfleet.worker", "rlfleet.worker.jobs", "rlfleet.cli.app", "rlfleet.cli"]
    assert imports_in("from .app import main\n", "rlfleet.cli", is_package=True) == [(1, "rlfleet.cli.app")]
    assert not allowed("cli", "rlfleet.worker.cli.app") and allowed("cli", "rlfleet.worker.runner")
    assert not allowed("bridge", "rlfleet.bots.core") and allowed("bridge", "rlfleet.shared.ingress.grammar")


def test_the_jobs_an_events_worker_imports_leave_torch_out():
    # RQ imports rlfleet.worker.jobs in every worker; an events worker only applies ratings, and torch
    # with transformers is seconds of start-up and hundreds of MB it never uses (the training job
    # imports them when it runs).
    code = ("import sys, rlfleet.worker.jobs; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
