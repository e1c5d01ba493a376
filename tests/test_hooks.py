"""Coding-agent hooks as the agents run them: `python -m rlfleet.bridge.hook` fed the documented stdin
payloads (Claude Code's and Codex's UserPromptSubmit and Stop), talking to a real bridge on 127.0.0.1,
spooling while it is down; and the settings merge / unmerge on files that hold other hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rq import Queue, SimpleWorker
from sqlalchemy import select
from test_bridge import running

from rlfleet.bridge import spool
from rlfleet.bridge.agents import install, uninstall
from rlfleet.bridge.app import make_app
from rlfleet.cli.setup import write_secret
from rlfleet.shared.config import load_config
from rlfleet.shared.queue import EVENTS_QUEUE, open_queue
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store

SESSION = "3f1c2a9e-8d7b-4c55-9e0f-2b6a1d4e7c10"


def run_hook(agent: str, event: str, payload: dict | bytes, home: Path) -> subprocess.CompletedProcess:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    env = {**os.environ, "RLFLEET_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "rlfleet.bridge.hook", agent, event], input=data,
                          capture_output=True, timeout=30, env=env)


def prompt_payload(prompt: str, transcript: Path, agent: str = "claude-code") -> dict:
    common = {"session_id": SESSION, "transcript_path": str(transcript), "cwd": "/work/repo",
              "hook_event_name": "UserPromptSubmit", "permission_mode": "default", "prompt": prompt}
    if agent == "codex":
        return {**common, "turn_id": "turn-7", "model": "gpt-5-codex"}
    return {**common, "prompt_id": "7b0c6b1e-1f7e-4b8a-9d55-0e3a4f2c1d00"}


def stop_payload(answer: str | None, transcript: Path, agent: str = "claude-code") -> dict:
    common = {"session_id": SESSION, "transcript_path": str(transcript), "cwd": "/work/repo",
              "hook_event_name": "Stop", "stop_hook_active": False, "last_assistant_message": answer}
    return {**common, "turn_id": "turn-7", "model": "gpt-5-codex"} if agent == "codex" else \
        {**common, "permission_mode": "default"}


@pytest.fixture
def bridge_home(queued_home):
    cfg = load_config()
    write_secret(cfg.secret_path)
    handle = open_queue(cfg)
    yield cfg, handle
    handle.close()


def work(cfg, handle) -> None:
    SimpleWorker([Queue(EVENTS_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)


def serve_bridge(cfg, handle):
    """The bridge on the configured port (the hooks read it from config.toml)."""
    app = make_app(cfg, handle)
    return running(app)


def _point_config_at(cfg, url: str) -> None:
    cfg.bridge.port = int(url.rsplit(":", 1)[1])
    cfg.save()


@pytest.mark.parametrize("agent", ["claude-code", "codex"])
def test_a_turn_is_captured_and_rl_good_rates_it_without_reaching_the_model(bridge_home, tmp_path, agent):
    cfg, handle = bridge_home
    transcript = tmp_path / "t.jsonl"
    with serve_bridge(cfg, handle) as url:
        _point_config_at(cfg, url)
        res = run_hook(agent, "prompt", prompt_payload("why is the build red?", transcript, agent), cfg.home)
        assert res.returncode == 0 and res.stdout == b""  # an ordinary prompt passes untouched
        res = run_hook(agent, "stop", stop_payload("The lockfile is stale.", transcript, agent), cfg.home)
        assert res.returncode == 0 and res.stdout == b""  # a Stop hook must not block the agent
        work(cfg, handle)
        rating = "/rl 5 spot on" if agent == "claude-code" else "/rl good spot on"  # stars, or a thumb
        res = run_hook(agent, "prompt", prompt_payload(rating, transcript, agent), cfg.home)
        out = json.loads(res.stdout)
        assert res.returncode == 0 and out["decision"] == "block"  # the model never sees /rl
        assert out["reason"] == "rlfleet: rated the last answer good"
        work(cfg, handle)
        res = run_hook(agent, "prompt", prompt_payload("/rl why", transcript, agent), cfg.home)
        assert json.loads(res.stdout)["reason"].startswith("rlfleet: say why after /rl why")
        res = run_hook(agent, "prompt", prompt_payload("/rl why found the stale lockfile", transcript, agent),
                       cfg.home)
        assert json.loads(res.stdout)["reason"] == "rlfleet: noted why, on your last rating"
        work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        cap = s.scalars(select(CaptureRow)).one()
        assert (cap.source, cap.conversation, cap.owner) == (agent, SESSION, "local")
        assert cap.prompt == [{"role": "user", "content": "why is the build red?"}]
        assert cap.response == "The lockfile is stale."
        assert cap.message_ref == ("turn-7" if agent == "codex" else "7b0c6b1e-1f7e-4b8a-9d55-0e3a4f2c1d00")
        ratings = s.scalars(select(RatingRow).order_by(RatingRow.id)).all()
        stars = 5 if agent == "claude-code" else None  # a reason said afterwards keeps them
        assert [(r.value, r.stars, r.comment, r.state, r.capture_id) for r in ratings] == [
            (1, stars, "spot on", "replaced", cap.id), (1, stars, "found the stale lockfile", "active", cap.id)]


def test_stop_without_a_remembered_prompt_reads_the_transcript(bridge_home, tmp_path):
    cfg, handle = bridge_home
    transcript = tmp_path / "t.jsonl"  # lines as Claude Code writes them (docs' SDK sessions example)
    transcript.write_text("\n".join(json.dumps(x) for x in [
        {"type": "summary", "summary": "earlier"},
        {"type": "user", "uuid": "a1", "sessionId": SESSION, "message": {"role": "user", "content": "list the tests"}},
        {"type": "assistant", "uuid": "a2", "parentUuid": "a1", "message": {"role": "assistant", "content": [
            {"type": "tool_use", "id": "tu1", "name": "Bash", "input": {"command": "ls tests"}}]}},
        {"type": "user", "uuid": "a3", "parentUuid": "a2", "message": {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu1", "content": "test_a.py"}]}},
        {"type": "assistant", "uuid": "a4", "parentUuid": "a3", "message": {"role": "assistant", "content": [
            {"type": "text", "text": "There is one: test_a.py."}]}},
    ]) + "\n")
    with serve_bridge(cfg, handle) as url:
        _point_config_at(cfg, url)
        assert run_hook("claude-code", "stop", stop_payload("There is one: test_a.py.", transcript),
                        cfg.home).returncode == 0
        work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        cap = s.scalars(select(CaptureRow)).one()
        assert cap.prompt[-1]["content"] == "list the tests" and cap.response == "There is one: test_a.py."


def test_with_the_bridge_down_everything_is_spooled_and_lands_exactly_once(bridge_home, tmp_path):
    cfg, handle = bridge_home
    transcript = tmp_path / "t.jsonl"
    cfg.bridge.port = 9  # nothing listens there
    cfg.save()
    assert run_hook("claude-code", "prompt", prompt_payload("q1", transcript), cfg.home).returncode == 0
    assert run_hook("claude-code", "stop", stop_payload("a1", transcript), cfg.home).returncode == 0
    res = run_hook("claude-code", "prompt", prompt_payload("/rl bad", transcript), cfg.home)
    assert "saved and applied when `rlfleet up` starts" in json.loads(res.stdout)["reason"]
    assert spool.pending(cfg.home) == 2 and handle.waiting_events() == 0

    with serve_bridge(cfg, handle) as url:  # the bridge drains the spool when it starts
        _point_config_at(cfg, url)
        for _ in range(100):
            if not spool.pending(cfg.home):
                break
            time.sleep(0.05)
        assert spool.pending(cfg.home) == 0
        work(cfg, handle)
        # the next hook finds nothing left to resend; a second drain of the same lines changes nothing
        assert run_hook("claude-code", "prompt", prompt_payload("/rl status", transcript), cfg.home).returncode == 0
    with Store(cfg.db_url).session() as s:
        assert [c.response for c in s.scalars(select(CaptureRow))] == ["a1"]
        assert [(r.value, r.state) for r in s.scalars(select(RatingRow))] == [(-1, "active")]


def test_a_bridge_that_does_not_answer_in_time_is_called_busy_not_down(bridge_home, tmp_path):
    """A socket that takes the connection and never answers (a bridge beside a run that fills every
    core): the rating is spooled and the user told the bridge is busy, not that rlfleet is not running."""
    import socket

    cfg, handle = bridge_home
    transcript = tmp_path / "t.jsonl"
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel completes the handshake: no reply
        cfg.bridge.port = silent.getsockname()[1]
        cfg.save()
        res = run_hook("claude-code", "prompt", prompt_payload("/rl bad too long", transcript), cfg.home)
        reason = json.loads(res.stdout)["reason"]
        assert "bridge is busy" in reason and "not running" not in reason, reason
        assert spool.pending(cfg.home) == 1
        status = json.loads(run_hook("claude-code", "prompt", prompt_payload("/rl status", transcript),
                                     cfg.home).stdout)["reason"]
        assert "did not answer within 1 s" in status and "not running" not in status, status
    res = run_hook("claude-code", "prompt", prompt_payload("/rl status", transcript), cfg.home)
    assert "rlfleet is not running" in json.loads(res.stdout)["reason"]  # now nothing listens: down


def test_a_spool_drained_twice_still_counts_once(bridge_home, tmp_path):
    cfg, handle = bridge_home
    body = spool.with_event_id({"prompt": "q", "response": "a", "conversation": "c"})
    spool.append(cfg.home, "POST", "/v1/captures", body)
    with serve_bridge(cfg, handle):
        pass  # drained on start
    spool.append(cfg.home, "POST", "/v1/captures", body)  # the same request again (a crash before delete)
    with serve_bridge(cfg, handle):
        pass
    work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        assert len(list(s.scalars(select(CaptureRow)))) == 1


def test_a_broken_payload_never_fails_the_agent(bridge_home):
    cfg, _ = bridge_home
    for payload in (b"{not json", b"[]", b'{"prompt": 5}'):
        res = run_hook("claude-code", "prompt", payload, cfg.home)
        assert res.returncode == 0 and res.stdout == b""
    assert run_hook("claude-code", "lunch", b"{}", cfg.home).returncode == 0
    log = (cfg.home / "logs" / "hooks.log").read_text()
    assert log.count("hook failed") >= 2 and cfg.secret_path.read_text().strip() not in log


OTHER_HOOKS = {
    "model": "opus",
    "hooks": {
        "PreToolUse": [{"matcher": "Bash", "hooks": [{"type": "command", "command": "/usr/local/bin/guard.sh"}]}],
        "Stop": [{"hooks": [{"type": "command", "command": "notify-send done"}]}],
    },
    "permissions": {"allow": ["Bash(npm test)"]},
}


@pytest.mark.parametrize("agent,env,filename", [("claude-code", "CLAUDE_CONFIG_DIR", "settings.json"),
                                                ("codex", "CODEX_HOME", "hooks.json")])
@pytest.mark.parametrize("layout", ["indent2", "compact"])
def test_settings_merge_and_unmerge_round_trip_byte_for_byte(home, tmp_path, monkeypatch, agent, env, filename,
                                                              layout):
    monkeypatch.setenv(env, str(tmp_path / "agent"))
    path = tmp_path / "agent" / filename
    path.parent.mkdir()
    original = (json.dumps(OTHER_HOOKS, indent=2) + "\n") if layout == "indent2" else json.dumps(OTHER_HOOKS)
    path.write_text(original)
    a, changed = install(agent, home, custom_home=True)
    assert changed and a.path == path
    merged = json.loads(path.read_text())
    assert merged["hooks"]["PreToolUse"] == OTHER_HOOKS["hooks"]["PreToolUse"]  # theirs untouched
    stop = merged["hooks"]["Stop"]
    assert stop[0] == OTHER_HOOKS["hooks"]["Stop"][0] and "rlfleet.bridge.hook" in stop[1]["hooks"][0]["command"]
    assert f"RLFLEET_HOME={home}" in merged["hooks"]["UserPromptSubmit"][0]["hooks"][0]["command"]
    assert list(path.parent.glob(f"{filename}.rlfleet-backup-*"))  # backed up first
    assert install(agent, home, custom_home=True) == (a, False)  # idempotent
    assert uninstall(agent, home) == (a, True)
    assert path.read_text() == original  # byte for byte


def test_unmerge_after_the_user_edited_the_file_removes_only_ours(home, tmp_path, monkeypatch):
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude"))
    path = tmp_path / "claude" / "settings.json"
    path.parent.mkdir()
    path.write_text(json.dumps(OTHER_HOOKS, indent=2) + "\n")
    install("claude-code", home, custom_home=False)
    edited = json.loads(path.read_text())
    edited["theme"] = "dark"  # the user changed something else meanwhile
    path.write_text(json.dumps(edited, indent=2) + "\n")
    uninstall("claude-code", home)
    assert json.loads(path.read_text()) == {**OTHER_HOOKS, "theme": "dark"}
    assert uninstall("claude-code", home)[1] is False  # nothing of ours left


def test_init_and_uninstall_from_the_cli(home, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rlfleet.cli.app import app

    monkeypatch.setenv("CODEX_HOME", str(tmp_path / "codex"))
    res = CliRunner().invoke(app, ["init", "--yes", "--no-check-model", "--agent", "codex"], catch_exceptions=False)
    assert res.exit_code == 0 and "codex: hooks installed in" in res.output and "/hooks" in res.output
    data = json.loads((tmp_path / "codex" / "hooks.json").read_text())
    assert set(data["hooks"]) == {"UserPromptSubmit", "Stop"}
    res = CliRunner().invoke(app, ["uninstall", "--agent", "codex"], catch_exceptions=False)
    assert res.exit_code == 0 and not (tmp_path / "codex" / "hooks.json").exists()


@pytest.mark.parametrize("settings", ["{not json", '{"hooks": {"Stop": "echo hi"}}', "[1, 2]"])
def test_init_with_an_agent_settings_file_it_cannot_edit_writes_nothing(home, tmp_path, monkeypatch, settings):
    from typer.testing import CliRunner

    from rlfleet.cli.app import app
    from rlfleet.shared.errors import BadInput

    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(tmp_path / "claude"))
    (tmp_path / "claude").mkdir()
    (tmp_path / "claude" / "settings.json").write_text(settings)
    before = sorted(p.relative_to(home) for p in home.rglob("*"))
    res = CliRunner().invoke(app, ["init", "--yes", "--no-check-model", "--threshold", "7", "--agent", "claude-code"])
    assert isinstance(res.exception, BadInput) and "settings.json" in str(res.exception)  # the CLI's one line
    assert "nothing was changed" in str(res.exception)
    assert sorted(p.relative_to(home) for p in home.rglob("*")) == before  # no config.toml, no secret
    assert (tmp_path / "claude" / "settings.json").read_text() == settings
    assert list((tmp_path / "claude").iterdir()) == [tmp_path / "claude" / "settings.json"]  # no backup either


def test_a_redis_that_is_down_spools_too_and_it_flushes_once_it_is_back(bridge_home, tmp_path):
    import redis

    from rlfleet.shared.queue import QueueHandle

    cfg, handle = bridge_home
    transcript = tmp_path / "t.jsonl"
    dead = QueueHandle(redis=redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2),
                       url="redis://127.0.0.1:1/0")
    with running(make_app(cfg, dead)) as url:  # the bridge is up, its Redis is not
        _point_config_at(cfg, url)
        run_hook("claude-code", "prompt", prompt_payload("q1", transcript), cfg.home)
        assert run_hook("claude-code", "stop", stop_payload("a1", transcript), cfg.home).returncode == 0
        assert spool.pending(cfg.home) == 1
        said = json.loads(run_hook("claude-code", "prompt", prompt_payload("/rl good", transcript),
                                   cfg.home).stdout)["reason"]
        assert "could not queue it (it answered 503)" in said and "not running" not in said, said
        assert spool.pending(cfg.home) == 2
    with serve_bridge(cfg, handle):  # Redis is back
        for _ in range(100):
            if not spool.pending(cfg.home):
                break
            time.sleep(0.05)
    work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        assert [c.response for c in s.scalars(select(CaptureRow))] == ["a1"]
        assert [r.value for r in s.scalars(select(RatingRow))] == [1]
