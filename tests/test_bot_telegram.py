"""The Telegram bot through python-telegram-bot's real dispatch (``Application.process_update``) and its
real webhook server, a fake Bot API on 127.0.0.1, a real Redis queue and the real worker."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import aiohttp
from botfakes import FakeTelegram
from botrig import ADMIN, OWNER, RATER, STRANGER, BotRig, bot_rig, run
from sqlalchemy import select
from telegram import Update

from rlfleet.bots.telegram import ALLOWED_UPDATES, build_application, webhook_app
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.ingress.replies import NOT_YOURS
from rlfleet.shared.schema import RatingRow
from rlfleet.shared.webserver import listening

GROUP = -100123
BOT_ID = 999


class TelegramRig:
    def __init__(self, base: BotRig, application, fake: FakeTelegram) -> None:
        self.base, self.app, self.fake = base, application, fake
        self.ratings, self.queued, self.drain = base.ratings, base.queued, base.drain
        self.errors: list[BaseException] = []
        self.tasks: list[asyncio.Task] = []
        self._update = 0
        self._msg = 0

    async def send(self, payload: dict) -> None:
        """Dispatch one update as PTB would; in the background, as handlers wait on the worker's answer."""
        self._update += 1
        update = Update.de_json({"update_id": self._update, **payload}, self.app.bot)
        self.tasks.append(asyncio.create_task(self.app.process_update(update)))
        await asyncio.sleep(0.01)

    def message(self, user: int, text: str, chat: int = GROUP, reply_to: dict | None = None, **extra) -> dict:
        self._msg += 1
        msg = {"message_id": self._msg, "date": int(time.time()), "text": text,
               "chat": {"id": chat, "type": "private" if chat > 0 else "supergroup"},
               "from": {"id": user, "is_bot": False, "first_name": f"u{user}"}, **extra}
        if reply_to is not None:
            msg["reply_to_message"] = reply_to
        return msg

    async def ask(self, user: int, text: str, chat: int = GROUP) -> dict:
        """@rlfleet_bot text in a group (or plain text in a private chat) -> the bot's answer message."""
        before = len(self.fake.of("sendMessage"))
        body = text if chat > 0 else f"@rlfleet_bot {text}"
        entities = [] if chat > 0 else [{"type": "mention", "offset": 0, "length": len("@rlfleet_bot")}]
        await self.send({"message": self.message(user, body, chat, entities=entities)})
        sent = (await self.fake.wait_for("sendMessage", before + 1))[-1]
        await self.drain()
        return {"message_id": 1000 + len(self.fake.of("sendMessage")) - 1, "chat": {"id": chat, "type": "supergroup"},
                "date": 0, "text": sent["text"], "from": {"id": BOT_ID, "is_bot": True, "first_name": "rlfleet"}}

    async def rl(self, user: int, args: str, chat: int = GROUP, reply_to: dict | None = None) -> str:
        """/rl args -> the text the bot replied with (to the sender)."""
        before = len(self.fake.of("sendMessage"))
        text = f"/rl {args}".strip()
        await self.send({"message": self.message(user, text, chat, reply_to,
                                                 entities=[{"type": "bot_command", "offset": 0, "length": 3}])})
        sent = await self.base.until(lambda: self.fake.of("sendMessage")[before:], f"reply to /rl {args}")
        return sent[0]["text"]

    async def react(self, user: int | None, answer: dict, old: list[str], new: list[str], **extra) -> None:
        who = {"user": {"id": user, "is_bot": extra.pop("is_bot", False), "first_name": "x"}} if user else \
            {"actor_chat": {"id": GROUP, "type": "supergroup"}}
        await self.send({"message_reaction": {
            "chat": {"id": answer["chat"]["id"], "type": "supergroup"}, "message_id": answer["message_id"],
            "date": int(time.time()), **who,
            "old_reaction": [{"type": "emoji", "emoji": e} for e in old],
            "new_reaction": [{"type": "emoji", "emoji": e} for e in new]}})

    async def press(self, user: int, answer: dict, data: str = "rl:1") -> str | None:
        before = len(self.fake.of("answerCallbackQuery"))
        await self.send({"callback_query": {"id": f"cb{self._update}", "chat_instance": "ci", "data": data,
                                            "from": {"id": user, "is_bot": False, "first_name": "x"},
                                            "message": answer}})
        got = await self.base.until(lambda: self.fake.of("answerCallbackQuery")[before:], "callback answer")
        return got[0].get("text")


@asynccontextmanager
async def rig(home, **settings):
    async with FakeTelegram(bot_id=BOT_ID) as fake, bot_rig("telegram", **settings) as base:
        application = build_application(base.core, "123:TEST", fake.url)
        r = TelegramRig(base, application, fake)

        async def fail(update, context):
            r.errors.append(context.error)

        application.add_error_handler(fail)  # PTB only logs handler errors: make them fail the test
        await application.initialize()
        try:
            yield r
            await asyncio.gather(*r.tasks)
        finally:
            await application.shutdown()
            assert not r.errors, r.errors


OWNER_ID, STRANGER_ID, RATER_ID, ADMIN_ID = (int(u) for u in (OWNER, STRANGER, RATER, ADMIN))


def test_a_mention_is_answered_as_a_reply_with_buttons_and_captured(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER_ID, "what is a monad?")
            sent = r.fake.of("sendMessage")[-1]
            assert sent["text"] == "answer to: what is a monad?"
            markup = json.loads(sent["reply_markup"])
            assert [b["callback_data"] for b in markup["inline_keyboard"][0]] == ["rl:1", "rl:-1"]
            assert [b["text"] for b in markup["inline_keyboard"][1]] == ["1★", "2★", "3★", "4★", "5★"]
            (cap,) = r.base.captures()
            assert (cap.source, cap.conversation, cap.owner) == ("telegram", str(GROUP), OWNER)
            assert cap.message_ref == f"{GROUP}:{answer['message_id']}"
            await r.send({"message": r.message(OWNER_ID, "chatter not for the bot")})  # not addressed: no answer
            await asyncio.sleep(0.1)
            assert len(r.fake.of("sendMessage")) == 1
    run(go())


def test_rl_in_a_group_rates_the_last_answer_or_the_one_replied_to(queued_home):
    async def go():
        async with rig(queued_home) as r:
            first = await r.ask(OWNER_ID, "q1")
            await r.ask(OWNER_ID, "q2")
            assert (await r.rl(OWNER_ID, "good nice")).startswith("rated good")
            assert (await r.rl(OWNER_ID, "bad", reply_to=first)).startswith("rated bad: answer to: q1")
            assert (await r.rl(STRANGER_ID, "good", reply_to=first)).startswith("only the person the bot answered")
            assert "nothing of yours" in await r.rl(OWNER_ID, "good", reply_to=r.message(STRANGER_ID, "not the bot's"))
            assert (await r.rl(OWNER_ID, "undo")) == "undid your bad rating"
            assert r.ratings() == [(OWNER, 1, "active"), (OWNER, -1, "undone")]
    run(go())


def test_reactions_rate_change_and_undo_and_strangers_are_ignored(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER_ID, "q1")
            await r.react(STRANGER_ID, answer, [], ["👍"])
            await r.react(None, answer, [], ["👍"])  # anonymous admin: no user
            await r.react(OWNER_ID, answer, [], ["🔥"])
            await r.react(OWNER_ID, {**answer, "message_id": 1}, [], ["👍"])  # not an answer of ours
            await asyncio.sleep(0.1)
            assert r.queued() == 0
            await r.react(OWNER_ID, answer, [], ["👍🏽"])
            await r.drain()
            assert r.fake.of("editMessageReplyMarkup") == []  # a 👍 and the strangers' reactions ask nothing
            await r.react(OWNER_ID, answer, ["👍🏽"], ["👎"])  # one update carries the change
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            # A 👎 reaction that counted offers the reasons under the answer, as the 👎 button does.
            (offer,) = await r.base.until(lambda: r.fake.of("editMessageReplyMarkup"), "the reasons offered")
            rows = offer["reply_markup"]
            rows = (json.loads(rows) if isinstance(rows, str) else rows)["inline_keyboard"]
            assert [b["text"] for row in rows[2:] for b in row] == list(REASONS)
            assert (await r.press(OWNER_ID, answer, rows[2][0]["callback_data"])) == "noted why it is bad: too long"
            await r.drain()
            await r.react(OWNER_ID, answer, ["👎"], [])
            await r.drain()
            assert r.ratings()[-1] == (OWNER, -1, "undone")
            await r.react(RATER_ID, answer, [], ["👎"])
            await r.drain()
            assert r.ratings()[-1] == (RATER, -1, "active")
    run(go())


def test_buttons_admin_commands_and_help(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER_ID, "q1")
            assert (await r.press(STRANGER_ID, answer)).startswith("only the person the bot answered")
            assert (await r.press(OWNER_ID, answer, "rl:-1")).startswith("rated bad")
            keyboard = await r.base.until(lambda: r.fake.of("editMessageReplyMarkup"), "the reasons offered")
            rows = keyboard[0]["reply_markup"]
            rows = (json.loads(rows) if isinstance(rows, str) else rows)["inline_keyboard"]
            assert [b["text"] for row in rows[2:] for b in row] == list(REASONS)
            assert (await r.press(STRANGER_ID, answer, rows[2][0]["callback_data"])) == NOT_YOURS
            assert (await r.press(OWNER_ID, answer, rows[2][2]["callback_data"])) == "noted why it is bad: wrong"
            restored = await r.base.until(lambda: r.fake.of("editMessageReplyMarkup")[1:], "the reasons gone")
            rows = restored[0]["reply_markup"]
            assert len((json.loads(rows) if isinstance(rows, str) else rows)["inline_keyboard"]) == 2  # thumbs, stars
            assert (await r.press(OWNER_ID, answer, "rlwhy:9")).startswith("not a reason of the menu")
            assert (await r.press(OWNER_ID, answer, "rl:7")) == "unknown button"
            assert await r.rl(OWNER_ID, "reset") == "/rl reset is for admins only"
            assert "already on the base model" in await r.rl(ADMIN_ID, "rollback")
            assert "one admin command per 30 s" in await r.rl(ADMIN_ID, "train")
            assert "/rl good [comment]" in await r.rl(OWNER_ID, "")
            assert r.ratings() == [(OWNER, -1, "replaced"), (OWNER, -1, "active")]
    run(go())


def test_the_stars_row_rates_in_stars_and_a_low_mark_asks_why(queued_home):
    async def go():
        async with rig(queued_home) as r:
            answer = await r.ask(OWNER_ID, "q1")
            assert (await r.press(OWNER_ID, answer, "rlstars:4")).startswith("rated good (4★)")
            assert await r.press(STRANGER_ID, answer, "rlstars:5") == NOT_YOURS
            assert await r.press(OWNER_ID, answer, "rlstars:7") == "unknown button"  # not one we sent
            assert r.fake.of("editMessageReplyMarkup") == []  # a 4★ is a 👍: no reasons asked
            assert (await r.press(OWNER_ID, answer, "rlstars:2")).startswith("re-rated bad (2★)")
            (offer,) = await r.base.until(lambda: r.fake.of("editMessageReplyMarkup"), "the reasons offered")
            rows = offer["reply_markup"]
            rows = (json.loads(rows) if isinstance(rows, str) else rows)["inline_keyboard"]
            assert [b["text"] for row in rows[2:] for b in row] == list(REASONS)
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            with r.base.store.session() as s:
                assert [row.stars for row in s.scalars(select(RatingRow).order_by(RatingRow.id))] == [4, 2]
    run(go())


def test_rl_for_another_bot_is_not_ours(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.ask(OWNER_ID, "q1")
            n = len(r.fake.of("sendMessage"))
            await r.send({"message": r.message(OWNER_ID, "/rl@other_bot good",
                                               entities=[{"type": "bot_command", "offset": 0, "length": 13}])})
            await asyncio.sleep(0.2)
            assert len(r.fake.of("sendMessage")) == n and r.queued() == 0
    run(go())


def test_webhook_checks_the_secret_token_header_and_refuses_bad_bodies(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.app.start()
            try:
                async with listening(webhook_app(r.app, "s3cret"), "127.0.0.1", 0) as port:
                    url = f"http://127.0.0.1:{port}/telegram"
                    update = {"update_id": 77, "message": r.message(OWNER_ID, "hello from a webhook", chat=OWNER_ID)}
                    async with aiohttp.ClientSession() as http:
                        for headers in ({"X-Telegram-Bot-Api-Secret-Token": "wrong"}, {}):
                            async with http.post(url, json=update, headers=headers) as resp:
                                assert resp.status == 403
                        ok = {"X-Telegram-Bot-Api-Secret-Token": "s3cret"}
                        for body in ("{oops", "[]"):
                            async with http.post(url, data=body, headers={**ok, "Content-Type": "application/json"}) \
                                    as resp:
                                assert resp.status == 400, body
                        await asyncio.sleep(0.2)
                        assert not r.fake.of("sendMessage") and r.queued() == 0
                        async with http.post(url, json=update, headers=ok) as resp:
                            assert resp.status == 200
                    sent = await r.fake.wait_for("sendMessage")
                    assert sent[0]["text"] == "answer to: hello from a webhook"
            finally:
                await r.app.stop()
    run(go())


def test_up_runs_an_enabled_bot_as_its_own_process_with_long_polling(queued_home, monkeypatch):
    """The `rlfleet up` path: BackgroundWorkers starts `rlfleet bot telegram` and an events worker as
    processes; the bot long-polls the fake Bot API, answers through the responder, the worker stores it."""
    from botfakes import FakeOpenAI

    from rlfleet.cli.fleet import BackgroundWorkers
    from rlfleet.shared.config import load_config
    from rlfleet.shared.store import Store

    async def go():
        async with FakeTelegram(bot_id=BOT_ID) as fake, FakeOpenAI() as llm:
            cfg = load_config()
            cfg.bots.telegram.enabled, cfg.bots.telegram.api_base = True, fake.url
            cfg.responder.url = f"{llm.url}/v1"
            cfg.save()
            monkeypatch.setenv("TELEGRAM_BOT_TOKEN", "123:TEST")
            fake.updates.append({"update_id": 1, "message": {
                "message_id": 5, "date": int(time.time()), "text": "hello from polling",
                "chat": {"id": OWNER_ID, "type": "private"},
                "from": {"id": OWNER_ID, "is_bot": False, "first_name": "o"}}})
            workers = BackgroundWorkers(cfg, which=("events",), bots=("telegram",))
            workers.start()
            try:
                sent = await fake.wait_for("sendMessage", timeout=90)
                assert sent[0]["text"] == "answer to: hello from polling"
                assert json.loads(fake.of("getUpdates")[0]["allowed_updates"]) == ALLOWED_UPDATES
                store = Store(cfg.db_url)
                deadline = time.monotonic() + 30
                while not store.find_capture("telegram", str(OWNER_ID), f"{OWNER_ID}:1000"):
                    assert time.monotonic() < deadline, "the events worker did not store the capture"
                    await asyncio.sleep(0.1)
                assert all(workers.alive().values())
            finally:
                workers.stop()
        assert (cfg.home / "logs" / "bot-telegram.log").exists()

    asyncio.run(asyncio.wait_for(go(), 150))
