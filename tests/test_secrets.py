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
