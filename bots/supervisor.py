"""One reconnect loop for every platform bot: a platform that is down, drops the connection or answers
with errors costs a retry with growing waits, never the process; and what the link is doing is
published for `rlfleet status` (shared/bothealth.py).

A platform file hands :func:`supervise` one connection attempt (``attempt``): it connects, tells the
:class:`Link` when it is connected, and returns or raises when that connection is over. Where an SDK
recovers by itself (discord.py resuming a session), it reports into the same Link.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable

import redis

from rlfleet.shared.bothealth import HEARTBEAT_TTL_S, BotHealth, health_key, now, publish
from rlfleet.shared.config import BotSettings
from rlfleet.shared.errors import ConfigError

log = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300


class Link:
    """The state of one bot's connection to its platform, kept in Redis while the bot runs."""

    def __init__(self, platform: str, conn: redis.Redis | None, secrets: tuple[str, ...] = ()) -> None:
        self.conn = conn
        self.secrets = tuple(s for s in secrets if s)
        self.health = BotHealth(platform=platform, state="connecting", since=now(), pid=os.getpid())
        self.connects = 0  # how many times it got connected: a fresh connection restarts the backoff

    @property
    def platform(self) -> str:
        return self.health.platform

    def connected(self) -> None:
        if self.health.state != "connected":
            self.connects += 1
            self.health = self.health.model_copy(update={"state": "connected", "since": now()})
            log.info("%s: connected", self.platform)
            self.publish()

    def failed(self, error: BaseException | str) -> None:
        """The platform could not be reached or refused: retrying (since the first failure in a row)."""
        at = now()
        update: dict = {"last_error": self.describe(error), "last_error_at": at}
        if self.health.state != "retrying":
            update |= {"state": "retrying", "since": at}
        self.health = self.health.model_copy(update=update)
        self.publish()

    def noted(self, error: BaseException | str) -> None:
        """A call to the platform failed while the link itself stays up (a reply from an HTTP-served bot):
        the last error, without a change of state."""
        self.health = self.health.model_copy(update={"last_error": self.describe(error), "last_error_at": now()})
        self.publish()

    def describe(self, error: BaseException | str) -> str:
        """One line, no secret (a Telegram URL carries the token in its path)."""
        if isinstance(error, BaseException):
            first = (str(error).strip().splitlines() or [""])[0]
            text = f"{error.__class__.__name__}: {first}" if first else error.__class__.__name__
        else:
            text = error
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text[:MAX_ERROR_CHARS]

    def publish(self) -> None:
        if self.conn is None:
            return
        try:
            publish(self.conn, self.health)
        except redis.RedisError as exc:  # Redis being away must not take the platform link with it
            log.warning("%s: cannot publish the bot's health (%s)", self.platform, exc.__class__.__name__)

    def withdraw(self) -> None:
        """The bot is stopping: no longer shown as connected (a killed bot's key expires instead)."""
        if self.conn is None:
            return
        try:
            self.conn.delete(health_key(self.platform))
        except redis.RedisError:
            pass

    async def heartbeat(self) -> None:
        while True:
            await asyncio.to_thread(self.publish)
            await asyncio.sleep(HEARTBEAT_TTL_S / 3)


async def supervise(
    link: Link,
    attempt: Callable[[], Awaitable[None]],
    settings: BotSettings,
    fatal: tuple[type[BaseException], ...] = (),
) -> None:
    """Run ``attempt`` again and again until cancelled, waiting ``retry_min_s`` after a failure and twice
    as long after each further one in a row (up to ``retry_max_s``, with jitter so that many bots do not
    come back at once). ``fatal`` errors (a refused token) end it as a ConfigError, as ConfigError does:
    no retry fixes those."""
    beat = asyncio.create_task(link.heartbeat())
    delay = settings.retry_min_s
    try:
        while True:
            connects = link.connects
            try:
                await attempt()
                error: BaseException | str = "the platform closed the connection"
            except ConfigError:
                raise
            except fatal as exc:
                raise ConfigError(f"{link.platform}: the platform refused the bot ({link.describe(exc)})") from None
            except Exception as exc:
                error = exc
            if link.connects != connects:
                delay = settings.retry_min_s
            link.failed(error)
            wait = min(delay * random.uniform(0.8, 1.2), settings.retry_max_s)
            log.warning("%s: %s; retrying in %.1f s", link.platform, link.health.last_error, wait)
            await asyncio.sleep(wait)
            delay = min(delay * 2, settings.retry_max_s)
    finally:
        beat.cancel()
        link.withdraw()
