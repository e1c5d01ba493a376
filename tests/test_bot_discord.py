"""The Discord bot through discord.py's real client: login, gateway handshake, the app-command tree and
raw reaction events, against a fake REST API and gateway on 127.0.0.1, a real Redis and the real worker."""

from __future__ import annotations

import asyncio
import itertools
from contextlib import asynccontextmanager
from typing import get_args

import discord
import yarl
from botfakes import FakeDiscord, _discord_user
from botrig import ADMIN, OWNER, RATER, STRANGER, BotRig, bot_rig, run
from sqlalchemy import select

from rlfleet.bots.discord import RlfleetClient
from rlfleet.shared.ingress.grammar import Verb
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.ingress.replies import NOT_YOURS
from rlfleet.shared.schema import RatingRow

BOT = "999"


def member(uid: str, bot: bool = False) -> dict:
    return {"user": _discord_user(uid, bot), "roles": [], "joined_at": "2026-01-01T00:00:00+00:00",
            "deaf": False, "mute": False, "flags": 0, "permissions": "0"}


class DiscordRig:
    def __init__(self, base: BotRig, client: RlfleetClient, fake: FakeDiscord) -> None:
        self.base, self.client, self.fake = base, client, fake
        self.ratings, self.queued, self.drain = base.ratings, base.queued, base.drain
        self._ids = itertools.count(100)

    async def ask(self, user: str, text: str) -> str:
        """@bot text in the guild channel -> the id of the bot's answer."""
        before = len(self.fake.of("/messages"))
        bot = _discord_user(BOT, bot=True)
        await self.fake.dispatch("MESSAGE_CREATE", self.fake.message(
            str(next(self._ids)), _discord_user(user), f"<@{BOT}> {text}", mentions=[bot], member=member(user)))
        await self.fake.wait_for("/messages", before + 1)
        await self.drain()
        return str(5000 + len(self.fake.of("/messages")) - 1)

    def _interaction(self, user: str, itype: int, data: dict, message: dict | None = None) -> dict:
        iid = str(next(self._ids))
        payload = {"id": iid, "application_id": BOT, "type": itype, "token": f"tok{iid}", "version": 1,
                   "guild_id": self.fake.guild, "channel_id": self.fake.channel,
                   "channel": {"id": self.fake.channel, "type": 0, "guild_id": self.fake.guild, "name": "general",
                               "position": 0, "permission_overwrites": []},
                   "member": member(user), "data": data, "app_permissions": "0", "locale": "en-US",
                   "guild_locale": "en-US", "entitlements": [], "authorizing_integration_owners": {}, "context": 0,
                   "attachment_size_limit": 26214400}
        if message is not None:
            payload["message"] = message
        return payload

    async def _followup(self, payload: dict) -> str:
        before = len(self.fake.of(f"/webhooks/{BOT}/{payload['token']}"))
        await self.fake.dispatch("INTERACTION_CREATE", payload)
        got = await self.base.until(lambda: self.fake.of(f"/webhooks/{BOT}/{payload['token']}")[before:],
                                    "interaction follow-up")
        assert got[0]["flags"] == 64  # ephemeral
        return got[0]["content"]

    async def rl(self, user: str, action: str, detail: str | None = None) -> str:
        options = [{"name": "action", "type": 3, "value": action}]
        if detail:
            options.append({"name": "detail", "type": 3, "value": detail})
        return await self._followup(self._interaction(user, 2, {"id": "1", "name": "rl", "type": 1,
                                                                "options": options}))

    async def press(self, user: str, answer: str, custom_id: str = "rl:1") -> str:
        msg = self.fake.message(answer, _discord_user(BOT, bot=True), "an answer")
        return await self._followup(self._interaction(user, 3, {"custom_id": custom_id, "component_type": 2}, msg))

    async def choose_stars(self, user: str, answer: str, value: str) -> str:
        msg = self.fake.message(answer, _discord_user(BOT, bot=True), "an answer")
        return await self._followup(self._interaction(
            user, 3, {"custom_id": "rl:stars", "component_type": 3, "values": [value]}, msg))

    async def react(self, user: str, answer: str, emoji: str, added: bool = True, bot: bool = False) -> None:
        data = {"user_id": user, "channel_id": self.fake.channel, "message_id": answer, "guild_id": self.fake.guild,
                "emoji": {"id": None, "name": emoji}, "type": 0, "burst": False}
        if added:
            data["member"] = member(user, bot)
        await self.fake.dispatch("MESSAGE_REACTION_ADD" if added else "MESSAGE_REACTION_REMOVE", data)
        await asyncio.sleep(0.1)


@asynccontextmanager
async def rig(home, monkeypatch, token: str = "TEST.TOKEN", **settings):
    async with FakeDiscord(bot_id=BOT) as fake:
        monkeypatch.setattr(discord.http.Route, "BASE", f"{fake.url}/api/v10")
        monkeypatch.setattr(discord.gateway.DiscordWebSocket, "DEFAULT_GATEWAY",
                            yarl.URL(fake.url.replace("http://", "ws://") + "/gateway"))
        async with bot_rig("discord", **settings) as base:
            client = RlfleetClient(base.core, sync_commands=True, guild_ready_timeout=0.1)
            task = asyncio.create_task(client.start(token))
            try:
                await asyncio.wait_for(client.wait_until_ready(), 10)
                yield DiscordRig(base, client, fake)
            finally:
                await client.close()
                await asyncio.wait_for(task, 10)


def test_start_syncs_the_rl_command_and_a_mention_is_answered_with_buttons(queued_home, monkeypatch):
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            synced = [c for c in r.fake.calls if c.path.endswith(f"/applications/{BOT}/commands")]
            assert synced and synced[0].body[0]["name"] == "rl"
            assert [c["value"] for c in synced[0].body[0]["options"][0]["choices"]] == list(get_args(Verb))
            answer = await r.ask(OWNER, "what is a monad?")
            post = r.fake.of("/messages")[-1]
            assert post["content"] == "answer to: what is a monad?"
            ids = [c["custom_id"] for row in post["components"] for c in row["components"]]
            assert ids == ["rl:1", "rl:-1", "rl:stars"]
            stars = [c for row in post["components"] for c in row["components"] if c["custom_id"] == "rl:stars"]
            assert [o["value"] for o in stars[0]["options"]] == ["5", "4", "3", "2", "1"]
            (cap,) = r.base.captures()
            assert (cap.source, cap.conversation, cap.message_ref, cap.owner) == ("discord", "222", answer, OWNER)
    run(go())


def test_the_stars_menu_under_an_answer_rates_in_stars(queued_home, monkeypatch):
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            answer = await r.ask(OWNER, "what is a monad?")
            assert (await r.choose_stars(OWNER, answer, "4")).startswith("rated good (4★)")
            assert await r.choose_stars(STRANGER, answer, "1") == NOT_YOURS
            assert await r.choose_stars(OWNER, answer, "7") == "not a star rating (1-5)"
            assert (await r.choose_stars(OWNER, answer, "1")).startswith("re-rated bad (1★)")
            await r.base.drain()
            assert r.base.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            with r.base.store.session() as s:
                assert [row.stars for row in s.scalars(select(RatingRow).order_by(RatingRow.id))] == [4, 1]
    run(go())


def test_slash_command_rates_undoes_and_guards_admin_actions(queued_home, monkeypatch):
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            await r.ask(OWNER, "q1")
            assert (await r.rl(OWNER, "good", "clear")).startswith("rated good")
            assert "nothing of yours to rate here" in await r.rl(STRANGER, "bad")
            assert await r.rl(OWNER, "why", "a clear example") == "noted why it is good: a clear example"
            assert await r.rl(OWNER, "undo") == "undid your good rating"
            assert await r.rl(STRANGER, "train") == "/rl train is for admins only"
            assert "already on the base model" in await r.rl(ADMIN, "rollback")
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, 1, "undone")]
    run(go())


def test_reactions_and_buttons_follow_the_owner_rules(queued_home, monkeypatch):
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            answer = await r.ask(OWNER, "q1")
            await r.react(STRANGER, answer, "👍")
            await r.react(OWNER, answer, "👍", bot=True)  # a bot's reaction
            await r.react(OWNER, "42", "👍")  # not our answer
            assert r.queued() == 0
            await r.react(OWNER, answer, "👍🏿")
            await r.drain()
            await r.react(OWNER, answer, "👍", added=False)
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "undone")]
            assert "only the person the bot answered" in await r.press(STRANGER, answer)
            assert (await r.press(RATER, answer, "rl:-1")).startswith("rated bad")
            assert r.ratings()[-1] == (RATER, -1, "active")
            offered = [c.body for c in r.fake.calls if "/webhooks/" in c.path][-1]  # the 👎's reply, with reasons
            buttons = [c for row in offered["components"] for c in row["components"]]
            assert [b["label"] for b in buttons] == list(REASONS)
            assert [b["custom_id"] for b in buttons][:2] == [f"rlwhy:1:{answer}", f"rlwhy:2:{answer}"]
            assert await r.press(STRANGER, answer, buttons[1]["custom_id"]) == NOT_YOURS
            assert await r.press(RATER, answer, buttons[1]["custom_id"]) == "noted why it is bad: too short"
            assert "not a reason of the menu" in await r.press(RATER, answer, f"rlwhy:77:{answer}")
            assert r.ratings()[-2:] == [(RATER, -1, "replaced"), (RATER, -1, "active")]
    run(go())


def test_a_thumbs_down_reaction_offers_the_reasons_under_the_answer(queued_home, monkeypatch):
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            answer = await r.ask(OWNER, "q1")
            edits = f"/channels/{r.fake.channel}/messages/{answer}"
            await r.react(STRANGER, answer, "👎")  # not theirs: nothing offered
            await r.react(OWNER, answer, "👍")
            await r.drain()
            assert r.fake.of(edits) == []
            await r.react(OWNER, answer, "👎")
            (offer,) = await r.base.until(lambda: r.fake.of(edits), "the reasons under the answer")
            rows = [[c["custom_id"] for c in row["components"]] for row in offer["components"]]
            assert rows == [["rl:1", "rl:-1"], ["rl:stars"], [f"rlwhy:{i}:{answer}" for i in range(1, 6)]]
            assert await r.press(STRANGER, answer, rows[2][0]) == NOT_YOURS
            assert len(r.fake.of(edits)) == 1  # a refused press leaves the reasons there
            assert await r.press(OWNER, answer, rows[2][3]) == "noted why it is bad: off-topic"
            (_, restored) = await r.base.until(lambda: r.fake.of(edits)[1:] and r.fake.of(edits), "reasons gone")
            assert [[c["custom_id"] for c in row["components"]] for row in restored["components"]] == \
                [["rl:1", "rl:-1"], ["rl:stars"]]
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "replaced"), (OWNER, -1, "active")]
    run(go())


def test_other_bots_are_not_answered_and_change_nothing(queued_home, monkeypatch):
    """Discord's gateway is authenticated by the bot token over TLS: there is no signature to forge and
    discord.py parses its payloads; what can reach us unwanted is other bots."""
    async def go():
        async with rig(queued_home, monkeypatch) as r:
            answer = await r.ask(OWNER, "q1")
            bot = _discord_user("777", bot=True)
            await r.fake.dispatch("MESSAGE_CREATE", r.fake.message(
                "901", bot, f"<@{BOT}> hi", mentions=[_discord_user(BOT, bot=True)], member=member("777", True)))
            await r.react("777", answer, "👍", bot=True)
            await asyncio.sleep(0.3)
            assert r.queued() == 0 and r.ratings() == [] and len(r.fake.of("/messages")) == 1
    run(go())
