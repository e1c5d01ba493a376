"""Each platform bot's link to its platform, as `rlfleet status` shows it: connected, or retrying since
when, and the last error. A bot process writes its own key with a TTL (its heartbeat); a key that
expired means the process is gone, so the bot shows as not running.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Literal

import redis
from pydantic import BaseModel, ValidationError

from .config import Config
from .events import PLATFORMS

log = logging.getLogger(__name__)

HEARTBEAT_TTL_S = 30  # a bot writes at least every third of this
State = Literal["connecting", "connected", "retrying"]


class BotHealth(BaseModel):
    platform: str
    state: State
    since: datetime  # when it entered `state`
    last_error: str | None = None  # one line, secrets removed
    last_error_at: datetime | None = None
    pid: int


def health_key(platform: str) -> str:
    return f"rlfleet:bot:{platform}:health"


def publish(conn: redis.Redis, health: BotHealth, ttl_s: int = HEARTBEAT_TTL_S) -> None:
    conn.set(health_key(health.platform), health.model_dump_json(), ex=ttl_s)


def read(conn: redis.Redis, platform: str) -> BotHealth | None:
    raw = conn.get(health_key(platform))
    if raw is None:
        return None
    try:
        return BotHealth.model_validate_json(raw)
    except ValidationError:
        log.warning("ignoring an unreadable health record for the %s bot", platform)
        return None


def bots_status(cfg: Config, conn: redis.Redis | None) -> dict[str, dict]:
    """Per bot that is enabled or has a live heartbeat: state, since, last error. ``not running`` when
    an enabled bot has no heartbeat (never started, exited, or stuck long enough for its key to expire)."""
    out: dict[str, dict] = {}
    for platform in PLATFORMS:
        health = read(conn, platform) if conn is not None else None
        if health is not None:
            out[platform] = health.model_dump(mode="json", exclude={"platform"})
        elif cfg.bots.get(platform).enabled:  # type: ignore[union-attr]
            out[platform] = {"state": "not running", "since": None, "last_error": None, "last_error_at": None,
                             "pid": None}
    return out


def now() -> datetime:
    return datetime.now(timezone.utc)
