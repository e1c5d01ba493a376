"""The hostile-input run ends with what it really sent per surface (hostile.tally): the figure a
nightly report quotes, counted, not worked out from the settings."""

from __future__ import annotations

from hostile import EXAMPLES, SENT


def pytest_terminal_summary(terminalreporter) -> None:
    if not SENT:
        return
    terminalreporter.section(f"hostile input sent (RLFLEET_FUZZ_EXAMPLES={EXAMPLES})")
    for surface, (cases, payloads) in sorted(SENT.items()):
        terminalreporter.write_line(f"{surface:<32} {payloads:>7,} payloads in {cases:>6,} cases")
