"""deploy/: the systemd unit installs as the README says and systemd accepts it without a warning."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[1] / "deploy" / "systemd" / "rlfleet.service"


def test_the_unit_runs_rlfleet_up_and_restarts_it(tmp_path):
    text = UNIT.read_text()
    service = text.split("[Service]", 1)[1].split("[Install]", 1)[0]
    assert "ExecStart=%h/.local/bin/rlfleet up\n" in service and "Restart=always" in service
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("no systemd-analyze here to check the unit with")
    rlfleet = Path(sys.executable).with_name("rlfleet")  # what `command -v rlfleet` finds in this venv
    installed = tmp_path / "rlfleet.service"
    installed.write_text(text.replace("%h/.local/bin/rlfleet", str(rlfleet)))  # the README's sed
    done = subprocess.run([analyze, "verify", str(installed)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stderr.strip() and not done.stdout.strip(), done.stderr
