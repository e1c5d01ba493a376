"""The CLI end to end through the real queue: event -> Redis -> RQ worker -> store -> status."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlfleet.cli.app import app
from rlfleet.shared.config import load_config
from rlfleet.shared.errors import BadInput
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store

runner = CliRunner()


def rl(*args, input=None):
    return runner.invoke(app, list(args), input=input, catch_exceptions=False)


def rl_main(*args):
    """Through main(): RlfleetError becomes one red line and an exit code."""
    return subprocess.run(MAIN + list(args), capture_output=True, text=True, timeout=60, env=os.environ.copy())


MAIN = [sys.executable, "-c", "from rlfleet.cli import main; main()"]


def status_json():
    res = rl("status", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_capture_rate_undo_and_status_json_contract(queued_home):
    res = rl("capture", "--prompt", "What is 2+2?", "--response", "4", "--message-ref", "m-1")
    assert res.exit_code == 0, res.output
    capture_id = res.output.strip()
    assert len(capture_id) == 36

    assert rl("good", "--target", "m-1", "--comment", "terse").exit_code == 0
    st = status_json()
    assert st["ratings"] == {"total": 1, "good": 1, "bad": 0, "pending": 1}
    assert st["threshold"] == 32 and st["model"] == "smollm2-135m"
    assert st["adapter"] == {"current": None, "versions": []}
    assert st["training"]["state"] == "idle" and st["training"]["error"] is None
    assert set(st["queue"]) == {"events", "train", "dead_letters"} and isinstance(st["workers"], int)
    assert isinstance(st["ema"], float)

    assert rl("bad").exit_code == 0  # re-rate the last answer
    assert status_json()["ratings"] == {"total": 1, "good": 0, "bad": 1, "pending": 1}
    assert rl("undo").exit_code == 0
    assert status_json()["ratings"]["total"] == 0


def test_a_capture_says_how_its_answer_ended_in_its_apis_word(queued_home):
    res = rl_main("capture", "--prompt", "q", "--response", "a", "--finish-reason", "lenght")
    assert res.returncode == 2 and "'lenght' is not one of stop" in res.stderr and "Traceback" not in res.stderr
    assert rl("capture", "--prompt", "q", "--response", "cut", "--finish-reason", "max_tokens").exit_code == 0
    with Store(load_config().db_url).session() as s:
        assert [(c.response, c.finish_reason) for c in s.query(CaptureRow)] == [("cut", "length")]


def test_why_gives_the_latest_rating_its_reason(queued_home):
    res = rl_main("why", "too long")
    assert res.returncode == 2 and "nothing you rated here yet" in res.stderr and "Traceback" not in res.stderr
    rl("capture", "--prompt", "q", "--response", "a long answer")
    assert rl("bad").exit_code == 0
    out = json.loads(rl("why", "too long", "--json").output)
    assert out["ok"] and out["message"] == "noted why it is bad: too long"
    with Store(load_config().db_url).session() as s:
        assert [(r.value, r.comment, r.state) for r in s.query(RatingRow).order_by(RatingRow.id)] == [
            (-1, None, "replaced"), (-1, "too long", "active")]
    assert status_json()["ratings"] == {"total": 1, "good": 0, "bad": 1, "pending": 1}


def test_rate_in_stars_keeps_them_beside_the_thumb(queued_home):
    rl("capture", "--prompt", "q", "--response", "an answer")
    res = rl_main("rate", "6")
    assert res.returncode == 2 and "less than or equal to 5" in res.stderr and "Traceback" not in res.stderr
    out = json.loads(rl("rate", "4", "--comment", "nearly", "--json").output)
    assert out["ok"] and out["message"] == "rated good (4★): an answer"
    rl("rate", "2")
    with Store(load_config().db_url).session() as s:
        assert [(r.value, r.stars, r.comment, r.state) for r in s.query(RatingRow).order_by(RatingRow.id)] == [
            (1, 4, "nearly", "replaced"), (-1, 2, None, "active")]
    assert status_json()["ratings"] == {"total": 1, "good": 0, "bad": 1, "pending": 1}


def test_why_may_follow_a_rating_in_words_as_in_the_chat(queued_home):
    rl("capture", "--prompt", "q", "--response", "an answer")
    assert rl("bad", "too", "long").exit_code == 0
    assert rl("good", "clear and short", "--target", "last").exit_code == 0
    assert rl("rate", "2", "rambles").exit_code == 0
    res = rl_main("bad", "too long", "--comment", "wrong")
    assert res.returncode == 2 and "not both" in res.stderr and "Traceback" not in res.stderr
    with Store(load_config().db_url).session() as s:
        assert [(r.value, r.stars, r.comment, r.state) for r in s.query(RatingRow).order_by(RatingRow.id)] == [
            (-1, None, "too long", "replaced"), (1, None, "clear and short", "replaced"),
            (-1, 2, "rambles", "active")]


def test_unknown_target_is_one_line_error_and_changes_nothing(queued_home):
    res = rl("good", "--target", "nope")
    assert res.exit_code == 2
    assert "no captured answer" in res.output
    assert status_json()["ratings"]["total"] == 0


def test_empty_and_huge_responses_are_refused(queued_home, tmp_path):
    res = rl_main("capture", "--prompt", "hi", "--response", "  ")
    assert res.returncode == 2 and "response is empty" in res.stderr and "Traceback" not in res.stderr
    big = tmp_path / "big.txt"
    big.write_text("x" * 10_000_000)
    res = rl_main("capture", "--prompt", f"@{big}", "--response", "ok")
    assert res.returncode == 2 and "limit" in res.stderr and "Traceback" not in res.stderr
    bad_utf8 = tmp_path / "bad.txt"
    bad_utf8.write_bytes(b"\xff\xfe\x00bad")
    res = rl_main("capture", "--prompt", f"@{bad_utf8}", "--response", "ok")
    assert res.returncode == 2 and "UTF-8" in res.stderr
    assert status_json()["ratings"]["total"] == 0


def test_unreachable_redis_is_a_clear_error(home, monkeypatch):
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    res = rl_main("good")
    assert res.returncode == 5
    assert "cannot reach Redis" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("bad", ["/dev/null/x", ""])
@pytest.mark.parametrize("cmd", ["status", "good"])
def test_a_home_that_cannot_be_a_data_dir_is_one_line_error_and_writes_nothing(home, tmp_path, monkeypatch, bad, cmd):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # an empty --home once meant "."
    res = rl_main("--home", bad, cmd)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert list(cwd.iterdir()) == [] and list(home.iterdir()) == []


def test_a_new_home_is_made_by_commands_that_write_and_said_once(queued_home, tmp_path):
    new = tmp_path / "typo-home"
    res = rl_main("--home", str(new), "status")  # only reads: nothing to show, nothing made
    assert res.returncode == 2 and f"no data dir at {new}" in res.stderr and not new.exists()
    res = rl_main("--home", str(new), "good")
    assert f"new data dir created at {new}" in res.stderr and new.is_dir()
    res = rl_main("--home", str(new), "good")
    assert "new data dir" not in res.stderr


@pytest.mark.parametrize("cmd", [["forget", "slack:U1", "--yes"], ["undo"], ["rollback"], ["promote", "v1"],
                                 ["why", "too long"], ["reset", "--yes"]])
def test_commands_that_change_what_is_there_refuse_a_missing_data_dir_and_make_none(queued_home, tmp_path,
                                                                                      monkeypatch, cmd):
    new = tmp_path / "typo-home"
    monkeypatch.setenv("RLFLEET_HOME", str(new))
    with pytest.raises(BadInput, match=f"no data dir at {new}"):
        rl(*cmd)
    assert not new.exists()


def test_capture_takes_stdin_for_one_of_prompt_and_response_only(queued_home):
    with pytest.raises(BadInput, match="only one of --prompt and --response can be -"):
        rl("capture", "--prompt", "-", "--response", "-", input="x")
    res = rl("capture", "--prompt", "-", "--response", "four", input="What is 2+2?")
    assert res.exit_code == 0 and len(res.output.strip()) == 36, res.output


def test_workers_that_died_without_tidying_up_do_not_count(queued_home, redis_url, rconn):
    from rq import Worker

    from rlfleet.shared.workers import forget_dead_workers

    # a real RQ registration whose process ended without its teardown, as after a SIGKILL
    code = ("import os, sys; from redis import Redis; from rq import Queue, SimpleWorker; "
            "c = Redis.from_url(sys.argv[1]); "
            "SimpleWorker([Queue('rlfleet:events', connection=c)], connection=c).register_birth(); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, redis_url], check=True, timeout=60)
    assert len(Worker.all(connection=rconn)) == 1  # RQ still lists it
    assert status_json()["workers"] == 0
    rl("capture", "--prompt", "q", "--response", "a", "--message-ref", "m-1")
    res = rl("good", "--target", "m-1")  # applied here, not left waiting for the dead worker
    assert res.exit_code == 0 and "queued" not in res.output, res.output
    assert status_json()["ratings"]["total"] == 1
    assert forget_dead_workers(rconn) == 1 and Worker.all(connection=rconn) == []


def test_missing_model_path_is_a_clear_error(home):
    res = rl_main("init", "--yes", "--model", "/no/such/model")
    assert res.returncode == 6 and "does not exist" in res.stderr
    assert not (home / "config.toml").exists()


def test_init_writes_config_and_a_private_secret(home):
    res = rl("init", "--yes", "--threshold", "8", "--preset", "careful", "--no-check-model")
    assert res.exit_code == 0, res.output
    text = (home / "config.toml").read_text()
    assert "threshold = 8" in text and 'preset = "careful"' in text
    secret = home / "secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_text().strip() not in res.output
    first = secret.read_text()
    rl("init", "--yes", "--no-check-model")
    assert secret.read_text() == first  # kept, never regenerated behind the user's back


def test_bad_preset_is_refused(home):
    res = rl_main("init", "--yes", "--preset", "reckless", "--no-check-model")
    assert res.returncode == 2 and "preset" in res.stderr


def test_rollback_with_no_versions_says_so(queued_home):
    res = rl("rollback")
    assert res.exit_code == 2 and "nothing to roll back" in res.output
    res = rl("rollback", "base")  # where it is already: said, not "rolled back"
    assert res.exit_code == 0 and "already on the base model" in res.output and "rolled back" not in res.output
    res = rl("rollback", "v0042")
    assert res.exit_code == 2 and "no adapter version v0042" in res.output
    res = rl("rollback", "42")
    assert res.exit_code == 2 and "no adapter version v0042" in res.output
    res = rl("rollback", "latest")
    assert res.exit_code == 2 and "'latest' is not a version name" in res.output
    res = rl("promote", " ")
    assert res.exit_code != 0 and "which version? give one" in res.output


def test_train_with_nothing_pending_says_so(queued_home):
    res = rl("train")
    assert res.exit_code == 2 and "nothing to train on" in res.output


def _rate_answers(n: int) -> str:
    """Capture and rate ``n`` answers good; the last rating's output (where the trigger's word shows)."""
    for i in range(n):
        assert rl("capture", "--prompt", f"question {i}", "--response", f"answer {i}").exit_code == 0
        res = rl("good")
        assert res.exit_code == 0, res.output
    return res.output


def test_while_paused_ratings_are_kept_but_start_no_run_and_train_still_does(queued_home, monkeypatch):
    monkeypatch.setenv("RLFLEET_THRESHOLD", "3")
    res = rl("pause")
    assert res.exit_code == 0 and "automatic training paused" in res.output
    assert "training run" not in _rate_answers(4)  # one over the threshold
    st = status_json()
    assert st["ratings"]["pending"] == 4 and st["queue"]["train"] == 0
    assert st["training"] == {"state": "idle", "error": None, "run_id": None, "progress": None, "paused": True}
    assert "paused" in rl("status").output
    res = rl("train")  # an explicit run is not held back
    assert res.exit_code == 0 and "training run 1 queued on 4 ratings" in res.output
    st = status_json()
    assert st["training"]["state"] == "queued" and st["training"]["paused"] is True and st["queue"]["train"] == 1


def test_a_pause_outlives_a_restart_with_an_empty_redis_and_resume_starts_the_run_at_once(queued_home, rconn,
                                                                                          monkeypatch):
    import rlfleet.worker.context as worker_context
    from rlfleet.shared.queue import open_queue
    from rlfleet.worker.runner import recover

    monkeypatch.setenv("RLFLEET_THRESHOLD", "3")
    assert rl("pause", "--json").exit_code == 0
    _rate_answers(3)
    assert "training run 1 queued" in rl("train").output
    rconn.flushdb()  # an embedded Redis starts empty: the queued run's job is gone with it
    monkeypatch.setattr(worker_context, "_CTX", None)  # and so is the worker
    handle = open_queue(load_config())
    try:
        notes = recover(load_config(), handle)  # what a worker runs when it starts
    finally:
        handle.close()
    assert any("automatic training is paused" in n for n in notes) and not any("queued on" in n for n in notes)
    assert "training run" not in _rate_answers(1)
    st = status_json()
    assert st["training"]["paused"] is True and st["queue"]["train"] == 0 and st["ratings"]["pending"] == 4

    res = rl("resume", "--json")
    assert res.exit_code == 0, res.output
    said = json.loads(res.output)
    assert said["message"] == "automatic training resumed" and said["paused"] is False
    assert said["training"] == "training run 2 queued on 4 ratings"  # the interrupted run, retried at once
    st = status_json()
    assert st["training"]["paused"] is False and st["training"]["state"] == "queued" and st["queue"]["train"] == 1
    assert "was not paused" in rl("resume").output  # again: nothing to resume, and never a second run
    assert status_json()["queue"]["train"] == 1


def test_resume_below_the_threshold_says_how_many_more_ratings_start_the_next_run(queued_home, monkeypatch):
    monkeypatch.setenv("RLFLEET_THRESHOLD", "3")
    rl("pause")
    _rate_answers(1)
    res = rl("resume")
    assert res.exit_code == 0 and "the next run starts after 2 more ratings" in res.output
    assert "training run 1 queued" in _rate_answers(2)  # training by itself again


def test_pause_and_resume_take_no_arguments_and_bad_input_changes_nothing(queued_home):
    for args in (["pause", "now"], ["pause", "--for", "1h"], ["paws"], ["resume", "--force"]):
        res = rl(*args)
        assert res.exit_code == 2, (args, res.output)
    assert status_json()["training"]["paused"] is False
    rl("pause")
    assert rl("resume", "later").exit_code == 2
    assert status_json()["training"]["paused"] is True


def test_reset_needs_yes_without_a_terminal(queued_home):
    res = rl_main("reset")
    assert res.returncode == 2 and "--yes" in res.stderr


@pytest.mark.parametrize("cmd", ["init", "chat", "capture", "good", "bad", "undo", "status", "train", "rollback",
                                 "reset", "up", "worker", "promote", "history", "web", "pause", "resume"])
def test_every_command_has_help(cmd):
    res = rl(cmd, "--help")
    assert res.exit_code == 0 and "Usage" in res.output


def test_help_shows_each_commands_help_as_paragraphs_that_the_terminal_wraps(monkeypatch):
    import inspect

    monkeypatch.setenv("COLUMNS", "1000")  # wide enough that no description wraps
    res = rl("--help")
    assert res.exit_code == 0
    rows = {line.split()[1]: line for line in res.output.splitlines() if line.startswith("│ ")}
    commands = [c for c in app.registered_commands if c.callback is not None and c.callback.__doc__]
    assert len(commands) > 20 and "rate" in rows
    for info in commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        first = " ".join(inspect.cleandoc(info.help or info.callback.__doc__).split("\n\n")[0].split())
        assert first in rows[name], (name, rows[name])
    # a command's own help: each paragraph rewrapped, none broken off where its docstring's line ended
    res = rl("web", "--help")
    assert "and printed here when this is a terminal (to a pipe" in res.output, res.output


def test_up_stops_workers_and_the_embedded_redis_on_sigterm(home, tiny_model_dir, monkeypatch):
    from rlfleet.shared.embedded_redis import EmbeddedRedis

    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    proc = subprocess.Popen(MAIN + ["up"], env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if EmbeddedRedis.running(home) and status_json()["workers"] == 2:
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        else:
            pytest.fail("rlfleet up did not start its workers")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not EmbeddedRedis.running(home)  # released, not orphaned


def test_up_on_a_data_dir_made_by_chat_starts_the_bridge_and_lists_every_child(home, tiny_model_dir, monkeypatch):
    import socket

    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    port, web_port = ports
    cfg = load_config()
    cfg.bridge.port, cfg.web.port = port, web_port
    cfg.save()  # no secret file: what `chat` leaves (only `init` wrote one)
    proc = subprocess.Popen(MAIN + ["up"], env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, "rlfleet up did not start the bridge"
            with socket.socket() as s, socket.socket() as w:
                if s.connect_ex(("127.0.0.1", port)) == 0 and w.connect_ex(("127.0.0.1", web_port)) == 0 \
                        and status_json()["workers"] == 2:
                    break
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        panel, said = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"made secret file {cfg.secret_path} (mode 0600)" in said
    assert stat.S_IMODE(cfg.secret_path.stat().st_mode) == 0o600
    assert f"rlfleet web on http://127.0.0.1:{web_port}/" in " ".join(said.split())
    token = cfg.web_token_path.read_text().strip()
    assert stat.S_IMODE(cfg.web_token_path.stat().st_mode) == 0o600 and token not in said + panel
    assert token not in "".join(p.read_text() for p in (home / "logs").glob("*"))  # nor in the children's logs
    for child in ("events", "train", "bridge", "web"):
        assert re.search(rf"^{child} +running \(log: ", panel, re.M), panel
    assert re.search(r"^bots +not started: none enabled: `rlfleet init --bot slack`", panel, re.M), panel
    assert re.search(r"^serve +not started: only for the bots", panel, re.M), panel


def test_a_killed_up_leaves_no_orphans(home, tiny_model_dir, monkeypatch):
    """SIGKILL runs no cleanup: the background workers notice their parent is gone and stop, and the
    last of them out stops the embedded Redis."""
    from rlfleet.shared.embedded_redis import EmbeddedRedis

    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    proc = subprocess.Popen(MAIN + ["up"], env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (EmbeddedRedis.running(home) and status_json()["workers"] == 2):
        assert time.monotonic() < deadline and proc.poll() is None, "rlfleet up did not start its workers"
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while EmbeddedRedis.running(home):
        assert time.monotonic() < deadline, f"the embedded Redis outlived its users: {_still_holding(home)}"
        time.sleep(0.5)


def _still_holding(home: Path) -> str:
    """Who still holds a lease, and what each child of `up` last logged (for a failure message)."""
    from rlfleet.shared.embedded_redis import LEASES, EmbeddedRedis

    try:
        leases = {k.decode(): v.decode() for k, v in EmbeddedRedis(home)._control().hgetall(LEASES).items()}
    except Exception as exc:  # the server went between the check and this read
        leases = {"error": repr(exc)}
    tails = {p.name: p.read_text(errors="replace")[-300:] for p in sorted((home / "logs").glob("*"))}
    return f"leases {leases}; logs {tails}"


def test_init_configures_bots_by_flags_and_by_the_wizard(home, monkeypatch):
    res = rl("init", "--yes", "--no-check-model", "--bot", "slack", "--admin", "slack:U012AB3CD",
             "--rater", "telegram:4242")
    assert res.exit_code == 0, res.output
    cfg = load_config()
    assert cfg.bots.slack.enabled and cfg.bots.slack.admins == ["U012AB3CD"]
    assert cfg.bots.telegram.raters == ["4242"] and not cfg.bots.telegram.enabled
    assert "bot slack: token from $SLACK_BOT_TOKEN (not set yet)" in res.output
    assert rl_main("init", "--yes", "--no-check-model", "--admin", "irc:1").returncode == 2

    # the wizard: model, preset, threshold, then the platforms and per platform token env, admins, raters
    monkeypatch.setattr("rlfleet.cli.setup._stdin_is_tty", lambda: True)
    answers = "\n".join(["smollm2-135m", "balanced", "32", "discord, teams",
                         "MY_DISCORD_TOKEN", "111-a,222", "-", "", "-", "333"]) + "\n"
    res = rl("init", "--no-check-model", input=answers)
    assert res.exit_code == 0, res.output
    cfg = load_config()
    assert [p for p in ("slack", "discord", "telegram", "teams") if cfg.bots.get(p).enabled] == ["discord", "teams"]
    assert cfg.bots.discord.token_env == "MY_DISCORD_TOKEN" and cfg.bots.discord.admins == ["111-a", "222"]
    assert cfg.bots.discord.raters == [] and cfg.bots.teams.admins == [] and cfg.bots.teams.raters == ["333"]


def test_a_run_trained_in_an_agents_own_process_is_running_while_it_lives_and_failed_once_it_is_gone(
        queued_home, rconn, monkeypatch):
    """An environment agent without background=True trains in its own process, with no training job:
    its lock (inline:<host>:<pid>) keeps `status` and a worker starting on the data dir from calling
    the run dead while that process lives; once it is gone, both do."""
    import socket
    import subprocess as sp

    import rlfleet.worker.context as worker_context
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import inline_holder, open_queue, train_lock_key
    from rlfleet.shared.store import Store
    from rlfleet.worker.runner import recover

    monkeypatch.setattr(worker_context, "_CTX", None)
    cfg = load_config()
    slug, store = model_slug(cfg.model), Store(cfg.db_url)
    run = store.create_run(slug)
    store.start_run(run, None)
    rconn.set(train_lock_key(slug), inline_holder())
    handle = open_queue(cfg)
    try:
        assert status_json()["training"]["state"] == "running"
        assert not any("interrupted" in n for n in recover(cfg, handle))
        assert store.get_run(run).state == "running" and rconn.exists(train_lock_key(slug))
        gone = sp.Popen(["true"])
        gone.wait()  # a pid that was an agent's and is no more
        rconn.set(train_lock_key(slug), f"inline:{socket.gethostname()}:{gone.pid}")
        st = status_json()["training"]
        assert st["state"] == "failed" and "stopped during the run" in st["error"]
        assert any(f"run {run} was interrupted" in n for n in recover(cfg, handle))
        assert store.get_run(run).state == "failed" and not rconn.exists(train_lock_key(slug))
    finally:
        handle.close()
