"""Every platform bot, started the way `rlfleet bot X` starts it (the platform module's ``run``), outlives
its platform: down at start, dropping the connection mid-stream, answering 5xx or garbage. Each time
the bot's task is still running afterwards, the next rating lands in the store, and the health
`rlfleet status` reads says connected / retrying since when / the last error. Fake platforms on
127.0.0.1, the real SDKs, a real Redis and the real worker; backoff kept short through the bots'
retry settings."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from datetime import datetime
from typing import Any

import aiohttp
import discord
import pytest
import yarl
from botfakes import (
    DROP,
    GARBAGE,
    FakeDiscord,
    FakeServer,
    FakeSlack,
    FakeTeamsConnector,
    FakeTelegram,
    _discord_user,
    free_port,
)
from botrig import OWNER, BotRig, bot_rig, run
from rich.console import Console
from slack_sdk.signature import SignatureVerifier

from rlfleet.bots.runner import platform_module
from rlfleet.shared.bothealth import HEARTBEAT_TTL_S, BotHealth, bots_status, health_key, read
from rlfleet.shared.config import load_config
from rlfleet.shared.errors import ConfigError
from rlfleet.shared.status import status_dict
from rlfleet.shared.status_view import render_status

FAST = {"retry_min_s": 0.05, "retry_max_s": 0.2}
TOKENS = {"DISCORD_BOT_TOKEN": "TEST.DISCORD.TOKEN", "SLACK_BOT_TOKEN": "xoxb-test-token",
          "SLACK_APP_TOKEN": "xapp-test-token", "SLACK_SIGNING_SECRET": "test-signing-secret",
          "TELEGRAM_BOT_TOKEN": "123:TESTTOKEN", "TELEGRAM_WEBHOOK_SECRET": "test-webhook-secret"}


class Outage:
    """One platform bot under test: its fake platform (not listening until :meth:`up`), the bot's real
    ``run`` as a task, and one exchange that ends in a rating."""

    platform = ""
    dials_at_start = True  # False: the platform calls the bot, and only the bot's replies can fail
    holds_a_connection = True  # a socket or polling loop the platform can drop (else: a reply is dropped)

    def __init__(self, base: BotRig, fake: FakeServer) -> None:
        self.base, self.fake = base, fake
        self.bot_port = free_port()  # where a bot the platform calls listens
        self.port = free_port()
        self.fake.url = f"http://127.0.0.1:{self.port}"
        self.task: asyncio.Task | None = None
        self._n = itertools.count(1)

    def configure(self, settings: Any) -> None:
        settings.api_base = self.fake.url

    def start_bot(self) -> None:
        self.configure(self.base.cfg.bots.get(self.platform))
        run_bot = platform_module(self.platform).run  # what `rlfleet bot X` runs
        self.task = asyncio.create_task(run_bot(self.base.core, self.base.cfg, **self.opts()))

    def opts(self) -> dict:
        return {}

    async def up(self) -> None:
        await self.fake.start(self.port)

    def alive(self) -> bool:
        assert self.task is not None
        if self.task.done():
            raise AssertionError(f"the {self.platform} bot stopped: {self.task.exception()!r}")
        return True

    def health(self) -> BotHealth | None:
        return read(self.base.handle.redis, self.platform)

    async def state(self, state: str, after: datetime | None = None, timeout: float = 20.0) -> BotHealth:
        """Wait until the published health is ``state`` (entered after ``after``), the bot alive all along."""
        deadline = time.monotonic() + timeout
        while True:
            self.alive()
            h = self.health()
            if h is not None and h.state == state and (after is None or h.since > after):
                return h
            if time.monotonic() > deadline:
                raise AssertionError(f"the {self.platform} bot is not {state}: {h}")
            await asyncio.sleep(0.05)

    async def reconnected(self, drop: Callable[[], Awaitable[None]]) -> BotHealth:
        before = (await self.state("connected")).since
        await drop()
        return await self.state("connected", after=before)

    async def rated(self) -> None:
        """Ask, get an answer, thumb it up: one more rating in the store."""
        n = len(self.base.ratings())
        await self.exchange()
        await self.base.until(lambda: len(self.base.ratings()) > n, f"a rating through {self.platform}")
        self.alive()

    def refuse(self) -> None:
        """5xx and a garbage body on the calls it makes first (its replies when it dials nothing at start)."""
        self.fake.fail(2, 500, self.first_call)
        self.fake.fail(1, GARBAGE, self.first_call)

    first_call = ""

    async def ask(self) -> None:  # pragma: no cover - overridden where the bot is called
        raise NotImplementedError

    async def exchange(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def drop(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def call_bot(self, path: str, body: dict, headers: dict | None = None, data: str | None = None) -> int:
        """POST to the bot's own endpoint, as the platform does (it may still be binding its port); the
        status. During an outage it may be a 5xx (Slack's HTTP mode cannot authorize an event while Slack
        is down, and Slack delivers it again): the rating that lands afterwards is the proof."""
        deadline = time.monotonic() + 10
        while True:
            try:
                async with aiohttp.ClientSession() as http, http.post(
                        f"http://127.0.0.1:{self.bot_port}{path}", json=None if data else body, data=data,
                        headers=headers or {}) as resp:
                    return resp.status
            except aiohttp.ClientConnectionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with suppress(asyncio.CancelledError):
                await asyncio.wait_for(self.task, 10)
        await self.fake.stop()


class DiscordOutage(Outage):
    platform = "discord"
    fake: FakeDiscord

    def __init__(self, base: BotRig, fake: FakeServer) -> None:
        super().__init__(base, fake)
        self.codes = itertools.cycle((4000, 1000))

    def configure(self, settings: Any) -> None:
        settings.api_base = f"{self.fake.url}/api/v10"  # the gateway must follow it: no DEFAULT_GATEWAY set here

    async def exchange(self) -> None:
        mid = str(100 + next(self._n))
        before = len(self.fake.of("/messages"))
        user = _discord_user(OWNER)
        await self.fake.dispatch("MESSAGE_CREATE", self.fake.message(
            mid, user, f"<@{self.fake.bot_id}> hello", mentions=[_discord_user(self.fake.bot_id, bot=True)]))
        await self.fake.wait_for("/messages", before + 1)
        answer = str(5000 + len(self.fake.of("/messages")) - 1)
        await self.base.drain()
        await self.fake.dispatch("MESSAGE_REACTION_ADD", {
            "user_id": OWNER, "channel_id": self.fake.channel, "message_id": answer, "guild_id": self.fake.guild,
            "emoji": {"id": None, "name": "👍"}, "type": 0, "burst": False,
            "member": {"user": user, "roles": [], "joined_at": "2026-01-01T00:00:00+00:00", "deaf": False,
                       "mute": False, "flags": 0, "permissions": "0"}})

    def refuse(self) -> None:
        """REST refuses the login, then the gateway refuses the websocket: discord.py's own reconnect
        ends the client on the second (AttributeError: 'NoneType' object has no attribute 'sequence')."""
        self.fake.fail(1, 503, "/users/@me")
        self.fake.fail(1, GARBAGE, "/users/@me")
        self.fake.fail(2, 500, "/gateway")

    async def drop(self) -> None:
        """A resumable close (discord.py resumes the session), then one it does not resume (a fresh
        client and IDENTIFY from the supervisor)."""
        await self.fake._ws.close(code=next(self.codes))


class SlackOutage(Outage):
    platform = "slack"
    fake: FakeSlack
    first_call = "/apps.connections.open"

    def configure(self, settings: Any) -> None:
        settings.api_base = f"{self.fake.url}/api/"

    def callback(self, event: dict) -> dict:
        n = next(self._n)
        return {"type": "event_callback", "team_id": "T1", "api_app_id": "A1", "event_id": f"Ev{n}",
                "event_time": int(time.time()), "event": event,
                "authorizations": [{"user_id": "UBOT", "is_bot": True, "team_id": "T1"}]}

    async def envelope(self, event: dict) -> None:
        await self.fake.socket.send_str(json.dumps({
            "envelope_id": f"env-{next(self._n)}", "type": "events_api", "accepts_response_payload": False,
            "payload": self.callback(event)}))

    async def ask(self) -> None:
        await self.envelope({"type": "app_mention", "user": OWNER, "text": "<@UBOT> hello", "channel": "C1",
                             "ts": f"1699999999.{next(self._n):06d}"})

    async def exchange(self) -> None:
        before = len(self.fake.of("chat.postMessage"))
        await self.ask()
        posts = await self.fake.wait_for("chat.postMessage", before + 1)
        await self.base.drain()
        await self.envelope({"type": "reaction_added", "user": OWNER, "reaction": "+1",
                             "item": {"type": "message", "channel": "C1", "ts": f"1700000000.{len(posts):06d}"},
                             "item_user": "UBOT", "event_ts": str(time.time())})

    async def drop(self) -> None:
        await self.fake.socket.close()


class SlackHttpOutage(SlackOutage):
    """HTTP mode: Slack posts signed events to the bot, and its replies are what can fail."""

    dials_at_start = holds_a_connection = False
    first_call = "/chat.postMessage"

    def configure(self, settings: Any) -> None:
        super().configure(settings)
        settings.http = True

    def opts(self) -> dict:
        return {"host": "127.0.0.1", "port": self.bot_port}

    async def envelope(self, event: dict) -> None:
        body, ts = json.dumps(self.callback(event)), str(int(time.time()))
        sig = SignatureVerifier(TOKENS["SLACK_SIGNING_SECRET"]).generate_signature(timestamp=ts, body=body)
        await self.call_bot("/slack/events", {}, data=body, headers={
            "Content-Type": "application/json", "X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig})

    async def drop(self) -> None:
        self.fake.fail(1, DROP, "/chat.postMessage")


class TelegramOutage(Outage):
    platform = "telegram"
    fake: FakeTelegram
    first_call = "/getMe"
    user = {"id": int(OWNER), "is_bot": False, "first_name": "o"}
    chat = {"id": int(OWNER), "type": "private"}

    async def deliver(self, update: dict) -> None:
        self.fake.updates.append({"update_id": next(self._n), **update})

    async def ask(self) -> None:
        await self.deliver({"message": {"message_id": next(self._n), "date": int(time.time()), "text": "hello",
                                        "chat": self.chat, "from": self.user}})

    async def exchange(self) -> None:
        before = len(self.fake.of("sendMessage"))
        await self.ask()
        sent = await self.fake.wait_for("sendMessage", before + 1, timeout=20)
        await self.base.drain()
        await self.deliver({"message_reaction": {
            "chat": self.chat, "message_id": 1000 + len(sent) - 1, "date": int(time.time()), "user": self.user,
            "old_reaction": [], "new_reaction": [{"type": "emoji", "emoji": "👍"}]}})

    async def drop(self) -> None:
        self.fake.fail(1, DROP, "/getUpdates")


class TelegramWebhookOutage(TelegramOutage):
    """Webhook mode: it registers the webhook at start (after getMe); then Telegram posts updates to it."""

    holds_a_connection = False

    def configure(self, settings: Any) -> None:
        super().configure(settings)
        settings.http, settings.webhook_url = True, "https://bot.example.invalid/telegram"  # only sent to the fake

    def opts(self) -> dict:
        return {"host": "127.0.0.1", "port": self.bot_port}

    async def deliver(self, update: dict) -> None:
        await self.call_bot("/telegram", {"update_id": next(self._n), **update},
                            headers={"X-Telegram-Bot-Api-Secret-Token": TOKENS["TELEGRAM_WEBHOOK_SECRET"]})

    async def drop(self) -> None:
        self.fake.fail(1, DROP, "/sendMessage")


class TeamsOutage(Outage):
    """Teams calls the bot: the platform that goes away is the connector its replies go to."""

    platform = "teams"
    fake: FakeTeamsConnector
    dials_at_start = holds_a_connection = False

    def configure(self, settings: Any) -> None:
        pass  # each activity names the connector (serviceUrl)

    def opts(self) -> dict:
        return {"host": "127.0.0.1", "port": self.bot_port}

    async def post(self, **fields: Any) -> None:
        await self.call_bot("/api/messages", {
            "id": f"in-{next(self._n)}", "channelId": "msteams", "serviceUrl": self.fake.url + "/",
            "from": {"id": f"29:{OWNER}", "name": "o", "aadObjectId": OWNER},
            "recipient": {"id": "28:bot", "name": "rlfleet"},
            "conversation": {"id": "19:chat", "conversationType": "personal"}, **fields})

    def replies(self) -> list[dict]:
        return [c.body for c in self.fake.calls if "/activities" in c.path]

    async def ask(self) -> None:
        await self.post(type="message", text="hello")

    async def exchange(self) -> None:
        before = len(self.replies())
        await self.ask()
        await self.base.until(lambda: len(self.replies()) > before, "the answer's reply")
        await self.post(type="messageReaction", replyToId=f"reply-{before + 1}", reactionsAdded=[{"type": "like"}])

    async def drop(self) -> None:
        self.fake.fail(1, DROP)


OUTAGES = {"discord": (DiscordOutage, FakeDiscord), "slack": (SlackOutage, FakeSlack),
           "slack-http": (SlackHttpOutage, FakeSlack), "telegram": (TelegramOutage, FakeTelegram),
           "telegram-webhook": (TelegramWebhookOutage, FakeTelegram), "teams": (TeamsOutage, FakeTeamsConnector)}


@asynccontextmanager
async def outage(platform: str, monkeypatch) -> AsyncIterator[Outage]:
    for name, value in TOKENS.items():
        monkeypatch.setenv(name, value)
    # run() points discord.py's class-wide URLs at the configured API (put back after the test); a
    # gateway that did not follow it would dial this dead loopback port, never Discord's
    monkeypatch.setattr(discord.http.Route, "BASE", discord.http.Route.BASE)
    monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                        yarl.URL(f"ws://127.0.0.1:{free_port()}/gateway"))
    cls, fake_cls = OUTAGES[platform]
    async with bot_rig(cls.platform, **FAST) as base:
        o = cls(base, fake_cls())
        try:
            yield o
        finally:
            await o.stop()


PLATFORMS = pytest.mark.parametrize("platform", list(OUTAGES))


@PLATFORMS
def test_a_platform_down_at_start_is_retried_until_it_comes_up(platform, queued_home, monkeypatch):
    async def go():
        async with outage(platform, monkeypatch) as o:
            o.start_bot()
            if not o.dials_at_start:  # the first reply is what fails
                await o.state("connected")
                await o.ask()
                await o.base.until(lambda: (h := o.health()) is not None and h.last_error, "the failed reply", 10)
            else:
                retrying = await o.state("retrying")
                assert retrying.last_error and retrying.since <= retrying.last_error_at
                await asyncio.sleep(0.5)  # several retries while it is down
            await o.up()
            await o.state("connected")
            await o.rated()
            h = o.health()
            assert h is not None and h.last_error and h.pid
            assert not any(t in h.model_dump_json() for t in TOKENS.values())
    run(go())


@PLATFORMS
def test_a_dropped_connection_is_reconnected_and_the_next_rating_lands(platform, queued_home, monkeypatch):
    async def go():
        async with outage(platform, monkeypatch) as o:
            await o.up()
            o.start_bot()
            await o.state("connected")
            await o.rated()
            if o.holds_a_connection:
                await o.reconnected(o.drop)
            else:  # an answer whose reply the platform cuts off
                await o.drop()
                await o.ask()
                await o.base.until(lambda: not o.fake.outage, "the dropped reply")
            await o.rated()
            if platform == "discord":
                await o.reconnected(o.drop)
                await o.rated()
            assert len(o.base.ratings()) == (3 if platform == "discord" else 2)
    run(go())


@PLATFORMS
def test_5xx_and_garbage_answers_are_survived_and_the_next_rating_lands(platform, queued_home, monkeypatch):
    async def go():
        async with outage(platform, monkeypatch) as o:
            o.refuse()
            await o.up()
            o.start_bot()
            if not o.dials_at_start:
                await o.state("connected")
                for _ in range(len(o.fake.outage)):
                    await o.ask()
            h = await o.state("connected")
            await o.base.until(lambda: not o.fake.outage, "every bad answer served")
            await o.rated()
            assert (o.health() or h).last_error
    run(go())


def test_status_shows_each_bot_connected_retrying_or_not_running(queued_home, monkeypatch):
    """`rlfleet status` (and --json) from another process's point of view: only what is in Redis."""
    async def go():
        async with outage("telegram", monkeypatch) as o:
            o.base.cfg.bots.slack.enabled = True  # enabled, never started: no heartbeat
            o.start_bot()
            await o.state("retrying")
            st = status_dict(o.base.cfg, o.base.handle)
            assert st["bots"]["slack"]["state"] == "not running"
            tg = st["bots"]["telegram"]
            assert tg["state"] == "retrying" and tg["since"] and tg["last_error"]
            console = Console(width=200, record=True)
            console.print(render_status(st))
            text = console.export_text()
            lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("bot ")}
            assert "retrying since" in lines["telegram"] and "last error" in lines["telegram"]
            assert "not running" in lines["slack"]
            await o.up()
            await o.state("connected")
            conn, cfg = o.base.handle.redis, o.base.cfg
            assert bots_status(cfg, conn)["telegram"]["state"] == "connected"
            assert 0 < conn.ttl(health_key("telegram")) <= HEARTBEAT_TTL_S  # a killed bot's record expires
            cfg.bots.telegram.enabled = True
            await o.stop()
            assert bots_status(cfg, conn)["telegram"]["state"] == "not running"
    run(go())


def test_retry_bounds_out_of_order_are_a_one_line_config_error(home):
    (home / "config.toml").write_text("[bots.slack]\nretry_min_s = 5\nretry_max_s = 1\n")
    with pytest.raises(ConfigError) as exc:
        load_config()
    assert "retry_max_s must be at least retry_min_s" in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(("platform", "path"), [("discord", "/users/@me"), ("telegram", "/getMe")])
def test_a_refused_token_stops_the_bot_with_a_one_line_reason(platform, path, queued_home, monkeypatch):
    """No retry fixes a token the platform refuses: the bot ends with that reason and no token in it."""
    async def go():
        async with outage(platform, monkeypatch) as o:
            o.fake.fail(1, 401, path)
            await o.up()
            o.start_bot()
            with pytest.raises(ConfigError) as exc:
                await asyncio.wait_for(o.task, 10)
            assert "refused" in str(exc.value) and "\n" not in str(exc.value)
            assert not any(t in str(exc.value) for t in TOKENS.values())
    run(go())
