"""Hostile argv for the `rlfleet` CLI: unknown commands and options, missing and malformed values, odd
unicode, rich markup, 100 kB arguments, bytes that are not UTF-8.

Properties: never a traceback; a nonzero exit (2 for a usage error) with one ``error: ...`` line on
stderr and nothing on stdout; and nothing changed: config.toml, the secret, adapters, agent settings,
the database rows and the queues are as they were. Most cases run ``main(argv)`` in process (fast); a
few go through the installed ``rlfleet`` script in a subprocess, bytes and all.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import signal
import sqlite3
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Annotated

import pytest

pytest.importorskip("hypothesis")
import typer  # noqa: E402
from hostile import SECRET, fuzz, odd_text, secrets_in, tally  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rlfleet.cli import app as cli  # noqa: E402
from rlfleet.shared.events import PLATFORMS  # noqa: E402

ROOT = typer.main.get_command(cli.app)
TOKENS = {"SLACK_BOT_TOKEN": "xoxb-FUZZ-SLACK-TOKEN-0001", "DISCORD_BOT_TOKEN": "FUZZ.DISCORD.TOKEN-0002",
          "TELEGRAM_BOT_TOKEN": "123:FUZZ-TELEGRAM-TOKEN-0003"}
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ERROR_LINE_MAX = 700  # one line a person reads: the message with at most 500 chars of echoed input, the hint


def _leaves(group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    found = []
    for name, cmd in group.commands.items():
        found += _leaves(cmd, (*path, name)) if hasattr(cmd, "commands") else [((*path, name), cmd)]
    return found


LEAVES = _leaves(ROOT)
GROUPS = {(): ROOT, **{(n,): c for n, c in ROOT.commands.items() if hasattr(c, "commands")}}


def _options(cmd) -> list:
    return [p for p in cmd.params if p.param_type_name == "option"]


def _names(cmd) -> set[str]:
    return {n for p in _options(cmd) for n in (*p.opts, *p.secondary_opts)}


def _arguments(cmd) -> list:
    return [p for p in cmd.params if p.param_type_name == "argument"]


_probe = typer.Typer()


@_probe.command()
def _int_option(n: Annotated[int, typer.Option()]) -> None:
    """The CLI's own int conversion, to know a generated value really is not an int."""


def parses_as_int(value: str) -> bool:
    try:
        typer.main.get_command(_probe).main(["--n", value], standalone_mode=False)
        return True
    except Exception:
        return False


INT_OPTIONS = {"--threshold", "--port", "--max-new-tokens"}
assert INT_OPTIONS <= {n for _, c in LEAVES for n in _names(c)}, "the CLI's int options changed"

# Argument values: odd text, never NUL (no OS can pass it in argv) and never --help (a valid request).
values = odd_text.map(lambda s: s.replace("\x00", "")).filter(lambda s: s != "--help")
# Bytes that are not UTF-8 reach Python's argv as lone surrogates (surrogateescape).
undecodable = st.builds(lambda a, c, b: a + c + b, st.text(max_size=5),
                        st.characters(min_codepoint=0xDC80, max_codepoint=0xDCFF), st.text(max_size=5))
positional = values.filter(lambda s: not s.startswith("-"))


@st.composite
def usage_errors(draw) -> list[str]:
    """argv with at least one error click finds while parsing, i.e. before any command runs: safe to
    aim at `up`, `chat`, `serve`, `worker`, `bot` and `bridge` as well."""
    kind = draw(st.sampled_from(["unknown_option", "missing_value", "bad_int", "flag_value", "extra_argument",
                                 "missing_required", "unknown_command", "undecodable"]))
    if kind == "unknown_command":
        prefix, group = draw(st.sampled_from(sorted(GROUPS.items())))
        name = draw(values.filter(lambda s: s not in group.commands and not s.startswith("--h") and s != "--"))
        return [*prefix, name, *draw(st.lists(values, max_size=3))]
    path, cmd = draw(st.sampled_from(LEAVES))
    opts, args = _options(cmd), _arguments(cmd)
    with_value = [p for p in opts if not p.is_flag]
    flags = [p for p in opts if p.is_flag]
    # Noise around the error: the command's own options with odd values (all optional ones).
    tokens: list[str] = []
    for p in draw(st.lists(st.sampled_from(opts), max_size=3)) if opts else []:
        tokens += [p.opts[0]] if p.is_flag else [p.opts[0], draw(values)]
    required = [] if kind == "missing_required" else [draw(positional) for a in args if a.required]
    if kind == "missing_required" and not any(p.required for p in cmd.params):
        kind = "unknown_option"
    if kind == "missing_value" and not with_value:
        kind = "unknown_option"
    if kind == "bad_int" and not [p for p in with_value if p.opts[0] in INT_OPTIONS]:
        kind = "unknown_option"
    if kind == "flag_value" and not flags:
        kind = "unknown_option"
    if kind == "extra_argument" and any(a.nargs == -1 for a in args):
        kind = "unknown_option"  # a command that takes words (`rlfleet bad too long`) takes any number
    if kind == "missing_required":
        tokens = [t for t in tokens if t not in {n for p in cmd.params if p.required for n in p.opts}]
        return [*path, *tokens]  # a required option or argument left out
    if kind == "unknown_option":
        known = {n[2:] for n in _names(cmd)} | {"help", ""}
        name = draw(values.filter(lambda s: s.split("=")[0] not in known))
        return [*path, *required, *tokens, "--" + name]
    if kind == "missing_value":
        return [*path, *required, *tokens, draw(st.sampled_from(with_value)).opts[0]]
    if kind == "bad_int":
        opt = draw(st.sampled_from([p for p in with_value if p.opts[0] in INT_OPTIONS]))
        return [*path, *required, *tokens, opt.opts[0], draw(values.filter(lambda s: not parses_as_int(s)))]
    if kind == "flag_value":
        flag = draw(st.sampled_from(flags))
        return [*path, *required, *tokens, f"{draw(st.sampled_from([*flag.opts, *flag.secondary_opts]))}="
                f"{draw(values)}"]
    if kind == "undecodable":
        return [*path, *required, *tokens, draw(undecodable)]
    # extra_argument: one positional more than the command takes
    return [*path, *[draw(positional) for _ in args], *tokens, draw(positional)]


def run_main(argv: list[str]) -> tuple[int, str, str]:
    """``cli.main(argv)`` in this process: (exit code, stdout, stderr). Whatever it changes in the
    environment, signal handlers and logger levels is put back; an exception other than SystemExit
    (a traceback) propagates and fails the test."""
    env = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    level = logging.getLogger("rlfleet").level
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                cli.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(env)
        for s, h in handlers.items():
            signal.signal(s, h)
        logging.getLogger("rlfleet").setLevel(level)
    return code, ANSI.sub("", out.getvalue()), ANSI.sub("", err.getvalue())


def assert_refused(argv: list[str], code: int, out: str, err: str, usage: bool) -> None:
    where = f"argv={[a[:60] for a in argv]!r} exit={code} stdout={out[:300]!r} stderr={err[:300]!r}"
    assert code != 0, where
    if usage:
        assert code == 2, where
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and len(lines[0]) <= ERROR_LINE_MAX, where
    assert "Traceback" not in err + out and "the worker failed on it" not in err, where
    assert out == "", where


def files_state(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` but the SQLite files (compared row by row instead: WAL checkpoints
    rewrite the bytes without changing a row)."""
    state = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.name.startswith("rlfleet.db"):
                state[str(p.relative_to(root.parent))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return state


def db_state(home: Path) -> dict[str, list[str]]:
    db = home / "rlfleet.db"
    if not db.exists():
        return {}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: sorted(repr(row) for row in con.execute(f'SELECT * FROM "{t}"')) for t in tables}
    finally:
        con.close()


def queue_state() -> dict[str, int]:
    if not os.environ.get("REDIS_URL"):
        return {}
    from redis import Redis
    from rq import Queue
    from rq.registry import FailedJobRegistry, ScheduledJobRegistry

    from rlfleet.shared.queue import EVENTS_QUEUE, TRAIN_QUEUE

    conn = Redis.from_url(os.environ["REDIS_URL"])
    state = {}
    for name in (EVENTS_QUEUE, TRAIN_QUEUE):
        q = Queue(name, connection=conn)
        state[f"{name} queued"] = q.count
        state[f"{name} failed"] = FailedJobRegistry(queue=q).count
        state[f"{name} scheduled"] = ScheduledJobRegistry(queue=q).count
    conn.close()
    return state


@pytest.fixture(autouse=True)
def _cwd_in_tmp(home, monkeypatch) -> None:
    """Commands run in a working dir of the test's own, compared like the data dir: a relative path a
    case hands ``export`` lands there, not in the checkout."""
    cwd = home.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    monkeypatch.chdir(cwd)


@pytest.fixture
def cli_home(home, monkeypatch, tmp_path) -> Path:
    """A data dir made by ``rlfleet init``, the agents' settings dirs inside the test's tmp dir, and bot
    tokens in the environment (to prove none is ever echoed)."""
    _set_up(home, monkeypatch, tmp_path)
    return home


def _set_up(home: Path, monkeypatch, tmp_path: Path, *commands: list[str]) -> None:
    """The agents' settings dirs inside the test's tmp dir, bot tokens in the environment, ``rlfleet init``
    and then ``commands`` (each must succeed), and the bridge secret."""
    agents = tmp_path / "agents"
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(agents / "claude"))
    monkeypatch.setenv("CODEX_HOME", str(agents / "codex"))
    for k, v in TOKENS.items():
        monkeypatch.setenv(k, v)
    for argv in (["init", "--yes", "--no-check-model"], *commands):
        code, _, err = run_main(argv)
        assert code == 0, (argv, err)
    (home / "secret").write_text(SECRET + "\n")


def _state(home: Path) -> tuple:
    return files_state(home, home.parent / "agents", home.parent / "cwd"), db_state(home), queue_state()


def _refused_and_unchanged(home: Path, caplog, argv: list[str], usage: bool) -> None:
    """``argv``, run in this process, is refused (see assert_refused), changes nothing, and shows no secret
    in its output or its log records."""
    before = _state(home)
    caplog.clear()  # the records of earlier cases are not this case's
    with caplog.at_level(logging.DEBUG):
        code, out, err = run_main(argv)
    assert_refused(argv, code, out, err, usage=usage)
    assert _state(home) == before, argv
    assert not secrets_in([SECRET, *TOKENS.values()], [out, err], caplog.records)


@fuzz()
@given(argv=usage_errors())
@example(argv=["fr\nob"])  # click's usage block and a boxed panel, not one line
@example(argv=["good", "--target"])
def test_usage_errors_are_one_line_exit_2_and_change_nothing(cli_home, caplog, argv):
    _refused_and_unchanged(cli_home, caplog, argv, usage=True)
    tally("CLI usage errors", 1)


def _not(valid) -> st.SearchStrategy[str]:
    return values.filter(lambda s: s not in valid)


def _bad_pair(s: str) -> bool:
    platform, _, uid = s.partition(":")
    return platform not in PLATFORMS or not uid.strip()


blank = st.text(st.sampled_from(" \t\n\r\u3000\u2028"), max_size=4)
bad_values = st.one_of(
    st.tuples(st.just("bot"), _not(PLATFORMS)).map(list),
    st.tuples(st.just("worker"), st.just("--queue"), _not({"events", "train", "all"})).map(list),
    st.one_of(
        _not({"careful", "balanced", "aggressive", ""}).map(lambda v: ["--preset", v]),  # "" means unset
        _not(PLATFORMS).map(lambda v: ["--bot", v]),
        _not({"claude-code", "codex"}).map(lambda v: ["--agent", v]),
        st.tuples(st.sampled_from(["--admin", "--rater"]), values.filter(_bad_pair)).map(list),
        st.integers().filter(lambda n: n < 1 or n > 100_000).map(lambda n: ["--threshold", str(n)]),
    ).map(lambda t: ["init", "--yes", "--no-check-model", *t]),
    st.tuples(st.sampled_from(["good", "bad"]), _not({"last", "m-1"}), values, values).map(
        lambda t: [t[0], "--target", t[1], "--comment", t[2], "--conversation", t[3]]),
    st.tuples(st.sampled_from(["rollback", "promote"]), values.filter(lambda s: s != "base")).map(list),
    st.tuples(values, blank).map(lambda t: ["capture", "--prompt", t[0], "--response", t[1]]),
    st.tuples(values, values, _not({"slack", "discord", "telegram", "teams", "cli", "web", "claude-code", "codex",
                                    "bridge", "gym"})).map(
        lambda t: ["capture", "--prompt", t[0] or "p", "--response", t[1] or "r", "--source", t[2]]),
    st.tuples(st.just("uninstall"), st.just("--agent"), _not({"claude-code", "codex"})).map(list),
    st.sampled_from([["reset"], ["reset", "--purge-ratings"], ["push"]]),
    values.map(lambda v: ["push", "--target", v]),
    st.tuples(st.just("export"), st.just("ratings"), _not({"jsonl", "datasets"})).map(
        lambda t: [*t[:2], "{home}/out.jsonl", "--format", t[2]]),
    values.map(lambda v: ["export", "adapter", "{home}/adapter-out", "--version", v]),
    values.map(lambda v: ["import", "ratings", "{home}/no-such-dir/" + v]),
    st.tuples(st.sampled_from(["rollback", "good", "bot", "export ratings", "uninstall --agent"]),
              undecodable).map(lambda t: [*t[0].split(), t[1]]),
)


@fuzz()
@given(argv=bad_values)
# What the fuzzer found, kept: rich markup in the echoed value (a MarkupError traceback), a lone surrogate
# (pydantic's serialiser raised), config.toml rewritten before an unknown agent was refused, and a file
# name too long for the file system (is_file() raised).
@example(argv=["bot", "[/x]"])
@example(argv=["rollback", "v\udcff"])
@example(argv=["init", "--yes", "--no-check-model", "--threshold", "7", "--agent", "bogus"])
@example(argv=["import", "ratings", "{home}/no-such-dir/" + "x" * 300])
def test_bad_values_are_refused_before_anything_changes(queued_home, monkeypatch, tmp_path, caplog, argv):
    """Well-formed commands with values that are wrong: the refusal comes before any write (the worker
    refuses the ones only it can judge: a rating of nothing, a version that does not exist)."""
    home = queued_home
    if not (home / "config.toml").exists():  # once per test: a capture and a rating to leave alone
        _set_up(home, monkeypatch, tmp_path,
                ["capture", "--prompt", "q", "--response", "a", "--message-ref", "m-1"], ["good", "--target", "m-1"])
    db = db_state(home)
    assert db["ratings"] and db["captures"]
    _refused_and_unchanged(home, caplog, [a.replace("{home}", str(home)) for a in argv], usage=False)
    tally("CLI bad values", 1)


def _entry_point() -> list[str]:
    script = Path(sys.executable).with_name("rlfleet")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rlfleet.cli"]


@pytest.mark.parametrize("argv", [
    [b"fr\nob", b"--x"],
    [b"rollback", b"\xff\xfe v1"],  # not UTF-8: a traceback from pydantic's serialiser before
    [b"bot", b"[/x]"],  # rich markup in the echo: a MarkupError traceback before
    [b"good", b"--comment", b"\xf0\x9f\x99\x83" * 20_000, b"--json=" + b"[bold]" * 10],
    [b"init", b"--yes", b"--no-check-model", b"--threshold", b"7", b"--agent", b"bogus"],  # wrote config first
], ids=["newline-command", "not-utf8", "markup", "huge-and-flag-value", "init-bad-agent"])
def test_the_installed_entry_point_refuses_hostile_argv(cli_home, argv):
    before = _state(cli_home)
    proc = subprocess.run(_entry_point() + argv, capture_output=True, timeout=60, env=os.environ.copy())
    out, err = (ANSI.sub("", x.decode("utf-8", "replace")) for x in (proc.stdout, proc.stderr))
    assert_refused([a.decode("utf-8", "replace") for a in argv], proc.returncode, out, err, usage=False)
    assert proc.returncode == 2
    assert _state(cli_home) == before
    assert not secrets_in([SECRET, *TOKENS.values()], [out, err])


def test_the_generators_really_hit_the_cli():
    """The strategies above must reach every command, and the int probe must agree with the CLI."""
    assert {p for p, _ in LEAVES} >= {("up",), ("chat",), ("bot",), ("export", "ratings"), ("import", "ratings")}
    assert parses_as_int(" 7 ") and parses_as_int("1_000") and not parses_as_int("7🙃")
