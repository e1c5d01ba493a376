"""Secrets come from env or a 0600 file, errors never carry them, and log lines lose them."""

from __future__ import annotations

import logging

import pytest

from rlfleet.shared.errors import ConfigError
from rlfleet.shared.secrets_file import read_secret, redact_in_logs


def test_env_first_then_a_private_file(tmp_path, monkeypatch):
    path = tmp_path / "token"
    path.write_text("from-file-secret\n")
    path.chmod(0o600)
    monkeypatch.setenv("RL_TEST_TOKEN", "from-env-secret")
    assert read_secret("RL_TEST_TOKEN", path, "the token") == "from-env-secret"
    monkeypatch.delenv("RL_TEST_TOKEN")
    assert read_secret("RL_TEST_TOKEN", path, "the token") == "from-file-secret"


@pytest.mark.parametrize("mode,content,fragment", [
    (0o644, "s3cret-value", "readable by others"),
    (0o600, "  \n", "is empty"),
])
def test_unsafe_or_empty_files_are_refused_without_echoing_them(tmp_path, mode, content, fragment):
    path = tmp_path / "token"
    path.write_text(content)
    path.chmod(mode)
    with pytest.raises(ConfigError, match=fragment) as exc:
        read_secret(None, path, "the token")
    assert "s3cret-value" not in str(exc.value)


def test_missing_says_where_it_looked(monkeypatch):
    monkeypatch.delenv("RL_TEST_NOPE", raising=False)
    with pytest.raises(ConfigError, match=r"set \$RL_TEST_NOPE"):
        read_secret("RL_TEST_NOPE", None, "the token")
    assert read_secret("RL_TEST_NOPE", None, "the token", required=False) is None


def test_log_lines_lose_the_secret_whoever_logs_them(caplog):
    assert caplog.handler in logging.getLogger().handlers  # pytest's capture, like a CLI's stderr handler
    redact_in_logs("123456:AAH-bot-token")
    with caplog.at_level(logging.INFO, logger="httpx"):
        logging.getLogger("httpx").info("POST %s", "https://api.telegram.org/bot123456:AAH-bot-token/getMe")
    assert caplog.messages == ["POST https://api.telegram.org/bot***/getMe"]


def test_a_url_from_the_environment_is_never_written_to_the_config_file(home, monkeypatch):
    """`DATABASE_URL=postgresql://u:pw@… rlfleet init` (or any save) leaves the password in the environment:
    the file keeps the URL it had, or none; a URL the user wrote there stays, in a file only they read."""
    import stat

    from rlfleet.shared.config import load_config

    monkeypatch.setenv("DATABASE_URL", "postgresql+psycopg://u:hunter2@127.0.0.1:5432/test")
    monkeypatch.setenv("REDIS_URL", "redis://:hunter3@127.0.0.1:6379/0")
    cfg = load_config()
    assert cfg.database_url.endswith("@127.0.0.1:5432/test")  # the process uses it
    path = cfg.save()
    assert "hunter" not in path.read_text() and "database_url" not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text('database_url = "sqlite:////tmp/mine.db"\n')  # the user's own
    load_config().save()
    assert 'database_url = "sqlite:////tmp/mine.db"' in path.read_text() and "hunter" not in path.read_text()
    monkeypatch.delenv("DATABASE_URL")
    monkeypatch.delenv("REDIS_URL")
    assert load_config().database_url == "sqlite:////tmp/mine.db" and load_config().redis_url is None
