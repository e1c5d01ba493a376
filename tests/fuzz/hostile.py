"""What the hostile-input tests share: how many cases to run, the values they are made of, and the scan
for secrets in replies and log lines.

CI runs the default counts; ``RLFLEET_FUZZ_EXAMPLES=10000`` is the nightly mode. A platform test starts
one bot and holds it open for all its cases (botrig.held), as the bot runs for months in a team; each
case sends a batch of ``BATCH`` payloads, and the payloads add up to the count. Every test tallies what
it really sent, and the run ends with the tally per surface (tests/fuzz/conftest.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

# Hypothesis checks isinstance(values, numpy.ndarray) whenever "numpy" is in sys.modules; a worker thread
# importing the jobs module (which imports numpy) mid-draw would leave it half-initialised there.
try:
    import numpy  # noqa: F401
except ImportError:  # without the training extra nothing imports it
    pass

EXAMPLES = int(os.environ.get("RLFLEET_FUZZ_EXAMPLES", "300"))
SECRET = "f" * 16 + "SECRET-VALUE-0123456789"
BATCH = 12  # payloads per case in the platform tests (more and hypothesis cannot generate them in its budget)
SENT: dict[str, list[int]] = {}  # surface -> [cases run, payloads sent]


def fuzz(cases: int = EXAMPLES) -> settings:
    """``cases`` cases (at least 2), reproducible, no per-case deadline."""
    return settings(max_examples=max(2, cases), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


def batched() -> settings:
    """The platform tests' settings: enough cases of ``BATCH`` payloads to send ``EXAMPLES`` in all, and
    no shrinking: the bot is held across cases, so once one case breaks it the next fail too, and only
    the first failure, as generated, says what did it."""
    return settings(fuzz(cases=-(-EXAMPLES // BATCH)), phases=[Phase.explicit, Phase.generate])


def held_case(step, caplog, surface: str, batch: list, send, calls: list) -> list:
    """One case on a held bot: ``send(batch)`` run by ``step`` with only this case's log records kept
    (at DEBUG) and counted for ``surface``; returns the requests the bot made meanwhile (``calls`` is the
    fake platform's record of them)."""
    caplog.clear()
    seen = len(calls)
    with caplog.at_level(logging.DEBUG):
        step(send(batch))
    tally(surface, len(batch))
    return calls[seen:]


def tally(surface: str, payloads: int) -> None:
    """Count one case of ``surface`` that sent ``payloads`` inbound payloads (tests/fuzz/conftest.py prints it)."""
    done = SENT.setdefault(surface, [0, 0])
    done[0] += 1
    done[1] += payloads


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)

# Text people and scripts really send: control and format characters (newlines, bidi overrides, zero
# width), combining marks, emoji, rich/console markup, format strings, path tricks, very long runs, and
# lone surrogates (what a JSON escape of half a character decodes to).
odd_text = st.one_of(
    st.text(max_size=60),
    st.text(st.characters(categories=["Cc", "Cf", "Zl", "Zp", "Mn", "So"]), min_size=1, max_size=20),
    st.sampled_from(["[/]", "[/x]", "[bold red]x", "\x1b[31mred", "\u202etxt", "a\u200bb", "line1\nline2", "\r\n",
                     "%s %(x)s {0} {}", "'; DROP TABLE ratings; --", "../../etc/passwd", "🙃" * 3, "NaN", "-1",
                     "null", "{}", "C:\\x", "\t", "nul\x00byte", "half \ud83d a pair", "\udcff"]),
    st.builds(lambda c, n: c * n, st.sampled_from(["x", "🙃", "\u0301", "[", "é"]), st.integers(300, 100_000)),
)


def secrets_in(secrets: Iterable[str], texts: Iterable[str] = (), records: Iterable[logging.LogRecord] = ()) -> list:
    """Every (secret, where) found in ``texts`` or in the formatted log ``records`` (message and traceback)."""
    fmt = logging.Formatter()
    found = []
    for secret in secrets:
        found += [(secret, text[:80]) for text in texts if secret in text]
        for r in records:
            line = fmt.format(r)
            if secret in line:
                found.append((secret, f"{r.name}: {line[:80]}"))
    return found


def chance(draw, percent: int) -> bool:
    return percent > 0 and draw(st.integers(0, 99)) < percent


def mutate(draw, value, percent: int, depth: int = 0):
    """``value`` with about ``percent`` % of its fields (at any depth) dropped, replaced by arbitrary
    JSON or mutated in turn, and now and then a stray field added: what a buggy or hostile sender makes
    of a valid payload."""
    if isinstance(value, dict) and depth < 3:
        out = {}
        for k, v in value.items():
            if not chance(draw, percent):
                out[k] = v
                continue
            how = draw(st.sampled_from(["drop", "replace", "deeper"]))
            if how == "replace":
                out[k] = draw(json_values)
            elif how == "deeper":
                out[k] = mutate(draw, v, max(percent, 30), depth + 1)
        if chance(draw, percent):
            out.update(draw(st.dictionaries(st.text(max_size=12), json_values, max_size=2)))
        return out
    if isinstance(value, list) and depth < 3:
        return [mutate(draw, v, percent, depth + 1) for v in value]
    return value


def replace_values(value, mapping: dict):
    """``value`` with every string or number equal to a key of ``mapping`` replaced, at any depth."""
    if isinstance(value, dict):
        return {k: replace_values(v, mapping) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_values(v, mapping) for v in value]
    if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) in mapping:
        return mapping[str(value)]
    return value


def our_crashes(records: Iterable[logging.LogRecord]) -> list[str]:
    """Error records that report an exception raised in rlfleet's own code (an SDK logs a crashed
    handler and carries on: the person just never gets a reply), and rlfleet's own error lines."""
    import rlfleet.bots
    import rlfleet.cli
    import rlfleet.shared

    ours = [os.path.dirname(m.__file__) + os.sep for m in (rlfleet.bots, rlfleet.cli, rlfleet.shared)]
    fmt = logging.Formatter()
    found = []
    for r in records:
        if r.levelno < logging.ERROR:
            continue
        trace = fmt.formatException(r.exc_info) if r.exc_info else ""
        if r.name.startswith("rlfleet") or any(f'File "{d}' in trace for d in ours):
            found.append(f"{r.name}: {r.getMessage()[:200]} {trace[-600:]}")
    return found
