"""The Teams bot through botbuilder's CloudAdapter behind the real aiohttp ``/api/messages`` endpoint on
127.0.0.1, a fake Bot Framework connector (the activities' serviceUrl), a real Redis and the real worker."""

from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import asynccontextmanager

import aiohttp
import pytest
from botfakes import FakeTeamsConnector
from botrig import ADMIN, OWNER, RATER, STRANGER, BotRig, bot_rig, run
from sqlalchemy import select

from rlfleet.bots.teams import web_app
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.ingress.replies import NOT_YOURS
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.webserver import listening

CONV = "19:team-chat"


class TeamsRig:
    def __init__(self, base: BotRig, url: str, connector: FakeTeamsConnector, http: aiohttp.ClientSession) -> None:
        self.base, self.url, self.connector, self.http = base, url, connector, http
        self.ratings, self.queued, self.drain = base.ratings, base.queued, base.drain
        self._ids = itertools.count(1)
        self.pending: list[asyncio.Task] = []

    def activity(self, user: str, **fields) -> dict:
        return {"id": f"in-{next(self._ids)}", "channelId": "msteams", "serviceUrl": self.connector.url + "/",
                "from": {"id": f"29:{user}", "name": f"u{user}", "aadObjectId": user},
                "recipient": {"id": "28:bot", "name": "rlfleet"},
                "conversation": {"id": CONV, "conversationType": "channel"}, **fields}

    async def post(self, activity: dict, headers: dict | None = None) -> int:
        async with self.http.post(self.url, json=activity, headers=headers or {}) as resp:
            return resp.status

    def send(self, activity: dict) -> None:
        """Post in the background: the turn waits for the worker's answer before it returns."""
        self.pending.append(asyncio.create_task(self.post(activity)))

    def replies(self) -> list[dict]:
        return [c.body for c in self.connector.calls if "/activities" in c.path]

    async def said(self, n: int) -> str:
        got = await self.base.until(lambda: self.replies()[n - 1:] or None, f"reply {n}")
        return got[0]["text"]

    async def ask(self, user: str, text: str) -> str:
        """@bot text in the channel -> the id of the bot's answer activity."""
        before = len(self.replies())
        self.send(self.activity(user, type="message", text=f"<at>rlfleet</at> {text}", entities=[
            {"type": "mention", "mentioned": {"id": "28:bot", "name": "rlfleet"}, "text": "<at>rlfleet</at>"}]))
        await self.said(before + 1)
        await self.drain()
        return f"reply-{before + 1}"

    async def rl(self, user: str, text: str, n: int) -> str:
        self.send(self.activity(user, type="message", text=f"<at>rlfleet</at> /rl {text}", entities=[
            {"type": "mention", "mentioned": {"id": "28:bot", "name": "rlfleet"}, "text": "<at>rlfleet</at>"}]))
        return await self.said(n)

    async def react(self, user: str, answer: str, kind: str, added: bool = True) -> None:
        key = "reactionsAdded" if added else "reactionsRemoved"
        self.send(self.activity(user, type="messageReaction", replyToId=answer, **{key: [{"type": kind}]}))
        await asyncio.sleep(0.3)


@asynccontextmanager
async def rig(home, app_id: str | None = None, password: str = "pw", **settings):
    async with FakeTeamsConnector() as connector, bot_rig("teams", app_id=app_id, **settings) as base:
        app = web_app(base.core, base.cfg.bots.teams, password if app_id else None)
        async with listening(app, "127.0.0.1", 0) as port, aiohttp.ClientSession() as http:
            r = TeamsRig(base, f"http://127.0.0.1:{port}/api/messages", connector, http)
            yield r
            assert all(s < 400 for s in await asyncio.gather(*r.pending))


def test_a_mention_is_answered_with_a_rating_card_and_captured(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER, "what is a monad?")
            reply = r.replies()[0]
            assert reply["text"] == "answer to: what is a monad?"
            card = reply["attachments"][0]
            assert card["contentType"] == "application/vnd.microsoft.card.adaptive"
            assert [a["data"] for a in card["content"]["actions"]] == [{"rl": 1}, {"rl": -1}, {"rl": "stars"}]
            (menu,) = card["content"]["body"]
            assert (menu["type"], menu["id"]) == ("Input.ChoiceSet", "stars")
            assert [c["value"] for c in menu["choices"]] == ["5", "4", "3", "2", "1"]
            (cap,) = r.base.captures()
            assert (cap.source, cap.conversation, cap.message_ref, cap.owner) == ("teams", CONV, answer, OWNER)
            assert cap.prompt[-1]["content"] == "what is a monad?"
    run(go())


def test_rl_text_commands_after_the_mention(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.ask(OWNER, "q1")
            assert (await r.rl(OWNER, "good", 2)).startswith("rated good")
            assert "nothing of yours to rate here" in await r.rl(STRANGER, "bad", 3)
            assert await r.rl(OWNER, "reset", 4) == "/rl reset is for admins only"
            assert "already on the base model" in await r.rl(ADMIN, "rollback", 5)
            assert "unknown command 'dance'" in await r.rl(OWNER, "dance", 6)
            assert r.ratings() == [(OWNER, 1, "active")]
    run(go())


def test_reactions_and_card_buttons_follow_the_owner_rules(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER, "q1")
            await r.react(STRANGER, answer, "like")
            await r.react(OWNER, "reply-99", "like")  # not an answer of ours
            await r.react(OWNER, answer, "heart")
            assert r.queued() == 0
            await r.react(OWNER, answer, "1f44e_thumbsdown_3")
            await r.drain()
            # A 👎 reaction that counted is answered with the reasons, as the 👎 button is.
            await r.base.until(lambda: r.replies()[1:] or None, "the reasons after a 👎 reaction")
            offer = r.replies()[1]["attachments"][0]["content"]
            assert [a["title"] for a in offer["actions"]] == list(REASONS)
            assert {a["data"]["ref"] for a in offer["actions"]} == {answer}
            r.send(r.activity(OWNER, type="message", value=offer["actions"][0]["data"], replyToId="reply-2"))
            assert await r.said(3) == "noted why it is bad: too long"
            await r.react(OWNER, answer, "1f44e_thumbsdown_3", added=False)
            await r.drain()
            assert r.ratings() == [(OWNER, -1, "replaced"), (OWNER, -1, "undone")]
            assert len(r.replies()) == 3  # removing a 👎 asks nothing
            r.send(r.activity(STRANGER, type="message", value={"rl": 1}, replyToId=answer))
            assert "only the person the bot answered" in await r.said(4)
            r.send(r.activity(RATER, type="message", value={"rl": 1}, replyToId=answer))
            assert (await r.said(5)).startswith("rated good")
            assert r.ratings()[-1] == (RATER, 1, "active")
            r.send(r.activity(RATER, type="message", value={"rl": -1}, replyToId=answer))
            await r.base.until(lambda: r.replies()[5:] or None, "the 👎's reply")
            card = r.replies()[5]["attachments"][0]["content"]  # with the reasons under it
            assert card["body"][0]["text"].startswith("re-rated bad")
            assert [a["title"] for a in card["actions"]] == list(REASONS)
            assert {a["data"]["ref"] for a in card["actions"]} == {answer}
            r.send(r.activity(STRANGER, type="message", value=card["actions"][4]["data"], replyToId="reply-6"))
            assert await r.said(7) == NOT_YOURS
            r.send(r.activity(RATER, type="message", value=card["actions"][4]["data"], replyToId="reply-6"))
            assert await r.said(8) == "noted why it is bad: tone"
            r.send(r.activity(RATER, type="message", value={"rlwhy": "x", "ref": answer}, replyToId="reply-6"))
            assert "not a reason of the menu" in await r.said(9)
            assert r.ratings()[-2:] == [(RATER, -1, "replaced"), (RATER, -1, "active")]
    run(go())


def test_the_stars_menu_on_the_card_rates_in_stars(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER, "q1")

            def submit(user: str, n: int, **value) -> None:
                r.send(r.activity(user, type="message", value=value, replyToId=answer))

            submit(OWNER, 2, rl="stars", stars="4")
            assert (await r.said(2)).startswith("rated good (4★)")
            submit(STRANGER, 3, rl="stars", stars="5")
            assert await r.said(3) == NOT_YOURS
            submit(OWNER, 4, rl="stars")  # ★ rate with nothing chosen
            assert await r.said(4) == "choose 1-5 stars in the menu first"
            submit(OWNER, 5, rl="stars", stars="9")  # not a choice the card offers
            assert await r.said(5) == "not a star rating (1-5)"
            submit(OWNER, 6, rl=True)
            assert await r.said(6) == "unknown button"
            submit(OWNER, 7, rl=1, stars="2")  # 👍 pressed with 2★ chosen: they disagree
            assert "could not record that" in await r.said(7)
            submit(OWNER, 8, rl=-1, stars="2")  # 👎 with 2★: both, and the reasons asked
            await r.base.until(lambda: r.replies()[7:] or None, "the 👎's reply")
            card = r.replies()[7]["attachments"][0]["content"]
            assert card["body"][0]["text"].startswith("re-rated bad (2★)")
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            with r.base.store.session() as s:
                assert [row.stars for row in s.scalars(select(RatingRow).order_by(RatingRow.id))] == [4, 2]
    run(go())


def test_auth_on_with_an_app_id_and_bad_bodies_change_nothing(queued_home):
    async def go():
        async with rig(queued_home, app_id="00000000-0000-0000-0000-000000000001") as r:
            assert await r.post(r.activity(OWNER, type="message", text="hi")) == 401
            async with r.http.post(r.url, data="{nope", headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400
            async with r.http.post(r.url, data="x", headers={"Content-Type": "text/plain"}) as resp:
                assert resp.status == 415
            async with r.http.post(r.url, data=b"x" * (2 << 20), headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 413
            await asyncio.sleep(0.1)
            assert r.queued() == 0 and not r.connector.calls
    run(go())


def test_without_an_app_id_the_bot_listens_only_on_loopback(queued_home):
    """No app id: no request is verified, so whoever reaches the port could speak as any user (an admin
    too). Beyond this machine the bot refuses to start; on loopback (the Emulator) it serves."""
    from rlfleet.bots import teams
    from rlfleet.shared.errors import ConfigError

    async def go():
        async with bot_rig("teams") as base:
            for host in ("0.0.0.0", "::", "192.168.1.20", "teams.example.com"):
                with pytest.raises(ConfigError, match=f"listen on {host} with no app_id"):
                    await teams.run(base.core, base.cfg, host=host, port=0)
            serving = asyncio.create_task(teams.run(base.core, base.cfg, host="127.0.0.1", port=0))
            await asyncio.sleep(0.5)
            assert not serving.done()  # listening, not refused
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
    run(go())


def run_without_warnings(coro, caplog) -> None:
    """Run ``coro`` and fail on any warning or error logged meanwhile: each of these turns used to fail
    quietly after a 201 ("teams turn failed" in the log, no reply)."""
    with caplog.at_level(logging.WARNING):
        run(coro)
    assert not [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]


def test_a_question_with_a_lone_surrogate_is_answered_captured_and_rateable(queued_home, caplog):
    """JSON may escape half a character ("\\ud800"); it decodes to a lone surrogate, which no store or
    UTF-8 body takes. Before: the answer went out, then the capture raised inside the turn (unrateable)."""
    async def go():
        async with rig(queued_home) as r:
            # json.dumps writes the lone surrogate as that escape
            assert await r.post(r.activity(OWNER, type="message", text="what is \ud800 this")) in (200, 201)
            assert await r.said(1) == "answer to: what is \ufffd this"
            await r.drain()
            (cap,) = r.base.captures()
            assert cap.prompt[-1]["content"] == "what is \ufffd this" and cap.response.endswith("\ufffd this")
            await r.react(OWNER, "reply-1", "like")
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "active")]
    run_without_warnings(go(), caplog)


def test_ids_no_reply_can_carry_are_a_400(queued_home, caplog):
    """The reply names the conversation in its x-ms-conversation-id header and both ids in its URL: an
    id with an emoji, a newline or an escape code, or one 77 kB long, failed the turn after a 201 (found
    by the nightly fuzz). A connector's ids are short printable ASCII; anything else is refused up front,
    and a plain id still works."""
    async def go():
        async with rig(queued_home) as r:
            for conv in ["🙃", "a\nb", "\x1b[31m", "x\x00", " Yv_i."]:
                act = r.activity(STRANGER, type="message", text="/rl dance", conversation={"id": conv})
                async with r.http.post(r.url, json=act) as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"] == ("malformed activity: conversation.id is not printable "
                                                            "ASCII without surrounding spaces")
            for field, long in (("conversation", {"id": "[" * 77_768}), ("id", "x" * 5000)):
                async with r.http.post(r.url, json={**r.activity(STRANGER, type="message", text="/rl dance"),
                                                    field: long}) as resp:
                    assert resp.status == 400 and "is over 1,024 characters" in (await resp.json())["error"]
            await asyncio.sleep(0.1)
            assert not r.connector.calls and r.queued() == 0
            plain = {"id": "19:abc@thread.skype;messageid=1"}
            r.send(r.activity(STRANGER, type="message", text="/rl dance", conversation=plain))
            assert "unknown command 'dance'" in await r.said(1)
    run_without_warnings(go(), caplog)


def test_ids_with_lone_surrogates_neither_crash_nor_lose_the_owner(queued_home, caplog):
    """Ids carry lone surrogates too: a reaction to a message id with one crashed the turn in the Redis
    lookup (found by the nightly fuzz). A user whose id has one still owns, and can rate, their answer."""
    odd = {"id": "29:half \ud83d a pair"}

    async def go():
        async with rig(queued_home) as r:
            like = {"type": "messageReaction", "reactionsAdded": [{"type": "like"}]}
            assert await r.post(r.activity(OWNER, replyToId=odd["id"], **like)) in (200, 201)
            assert await r.post({**r.activity(OWNER, type="message", text="a question"), "from": odd}) in (200, 201)
            assert await r.said(1) == "answer to: a question"
            await r.drain()
            (cap,) = r.base.captures()
            assert cap.owner == "29:half \ufffd a pair"
            assert await r.post({**r.activity(OWNER, replyToId="reply-1", **like), "from": odd}) in (200, 201)
            await r.drain()
            assert r.ratings() == [("29:half \ufffd a pair", 1, "active")]
    run_without_warnings(go(), caplog)
