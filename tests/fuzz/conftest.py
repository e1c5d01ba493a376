"""The hostile-input run ends with what it really sent per surface (hostile.tally): the figure a
nightly report quotes, counted, not worked out from the settings. The nightly mode's tests run for
minutes each, so their time limit grows with the count."""

from __future__ import annotations

import pytest
from hostile import EXAMPLES, SENT


def pytest_collection_modifyitems(items) -> None:
    if EXAMPLES > 300:
        for item in items:
            item.add_marker(pytest.mark.timeout(EXAMPLES // 10 + 300))  # 1,300 s at 10,000


def pytest_terminal_summary(terminalreporter) -> None:
    if not SENT:
        return
    terminalreporter.section(f"hostile input sent (RLFLEET_FUZZ_EXAMPLES={EXAMPLES})")
    for surface, (cases, payloads) in sorted(SENT.items()):
        terminalreporter.write_line(f"{surface:<32} {payloads:>7,} payloads in {cases:>6,} cases")
