"""mypy over the five packages under the names they are installed as (rlfleet.shared, .bots, .bridge,
.worker, .cli), with the settings in pyproject.toml's [tool.mypy]; the test fails listing mypy's errors.

mypy cannot follow the import hook an editable install uses, and the folders' own names (shared/,
worker/, ...) are not the import names, so the test builds the installed layout from pyproject's
package-dir out of symlinks (.mypy_cache/src/rlfleet/<package> -> its folder) and checks that.
worker/cli/ is rlfleet.cli only: checking rlfleet.worker leaves the folder out, so no file is read
as two modules.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".mypy_cache"  # gitignored; mypy's own cache lives there too
SHIM = CACHE / "src"


def package_dirs() -> dict[str, Path]:
    """{"rlfleet.shared": ROOT / "shared", ...}: the top-level packages and their folders."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = pyproject["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def build_shim(packages: dict[str, Path]) -> None:
    for name, folder in packages.items():
        link = SHIM.joinpath(*name.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() and Path(os.readlink(link)) == folder:
            continue
        if link.is_symlink():
            link.unlink()
        try:
            link.symlink_to(folder, target_is_directory=True)
        except FileExistsError:  # a run beside this one made it the same moment
            pass


def nested_packages(packages: dict[str, Path]) -> list[str]:
    """The package folders that lie inside another package's folder (worker/cli/ inside worker/), as the
    paths mypy would find them at through the outer package's link."""
    nested = []
    for name, folder in packages.items():
        for outer, outer_folder in packages.items():
            if outer != name and folder.is_relative_to(outer_folder):
                inner = folder.relative_to(outer_folder).as_posix()
                nested.append("/".join(["src", *outer.split("."), inner]) + "/")
    return nested


def real_path(line: str, packages: dict[str, Path]) -> str:
    """mypy's `.mypy_cache/src/rlfleet/cli/app.py:3: error ...` as `worker/cli/app.py:3: error ...`."""
    for name, folder in sorted(packages.items(), key=lambda item: -len(item[0])):
        prefix = str(SHIM.joinpath(*name.split(".")).relative_to(ROOT)) + os.sep
        if line.startswith(prefix):
            return str(folder.relative_to(ROOT)) + os.sep + line[len(prefix):]
    return line


def run_mypy() -> tuple[int, list[str], dict[str, Path]]:
    packages = package_dirs()
    build_shim(packages)
    exclude = "|".join(re.escape(path) for path in nested_packages(packages))
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(CACHE), "--no-error-summary", "--hide-error-context", "--no-pretty",
               *(["--exclude", exclude] if exclude else [])]
    for name in sorted(packages):
        command += ["-p", name]
    env = {**os.environ, "MYPYPATH": str(SHIM)}
    env.pop("PYTHONPATH", None)  # mypy searches it too: the links above are the one way to our files
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [real_path(line, packages) for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines, packages


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[dev]')")
def test_the_packages_type_check():
    code, lines, packages = run_mypy()
    assert code == 0 and not lines, "mypy (settings in pyproject.toml [tool.mypy]):\n" + "\n".join(lines)
    assert {"rlfleet.shared", "rlfleet.bots", "rlfleet.bridge", "rlfleet.worker", "rlfleet.cli"} <= set(packages)


def test_the_check_reads_each_file_under_its_installed_name_only():
    packages = package_dirs()
    assert nested_packages(packages) == ["src/rlfleet/worker/cli/", "src/rlfleet/worker/gym/"]
    line = str(SHIM.relative_to(ROOT) / "rlfleet" / "cli" / "app.py") + ":3: error: x"
    assert real_path(line, packages) == str(Path("worker", "cli", "app.py")) + ":3: error: x"
