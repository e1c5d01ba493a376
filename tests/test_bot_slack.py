"""The Slack bot through slack-bolt's real dispatch (signed requests), a fake Slack Web API and a fake
OpenAI-compatible responder on 127.0.0.1, a real Redis queue and the real worker."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from urllib.parse import urlencode

import aiohttp
import pytest
from botfakes import FakeSlack
from botrig import ADMIN, OWNER, RATER, STRANGER, BotRig, bot_rig, run
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.signature import SignatureVerifier
from sqlalchemy import select

from rlfleet.bots.core import BotCore
from rlfleet.bots.slack import BAD_ACTION, GOOD_ACTION, STARS_ACTION, bolt_request, build_app, http_app
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.ingress.replies import NOT_YOURS
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store
from rlfleet.shared.webserver import listening

SECRET = "test-signing-secret"
CHANNEL = "C1"


@dataclass
class Signed:
    body: str
    headers: dict[str, str]

    def bolt(self) -> AsyncBoltRequest:
        return bolt_request(self.body, self.headers)  # what the HTTP endpoint hands bolt


class SlackRig:
    def __init__(self, base: BotRig, app, slack: FakeSlack) -> None:
        self.base, self.app, self.slack = base, app, slack
        self.store, self.llm, self.cfg, self.handle = base.store, base.llm, base.cfg, base.handle
        self.drain, self.ratings, self.queued = base.drain, base.ratings, base.queued
        self._n = 0

    # ---- requests as Slack sends them --------------------------------------------------------------

    def signed(self, body: str, content_type: str, ts: int | None = None, secret: str = SECRET) -> Signed:
        ts = int(time.time()) if ts is None else ts
        sig = SignatureVerifier(secret).generate_signature(timestamp=str(ts), body=body)
        return Signed(body, {"content-type": content_type, "x-slack-request-timestamp": str(ts),
                             "x-slack-signature": sig})

    async def command(self, user: str, text: str, **kw):
        self._n += 1
        body = urlencode({"command": "/rl", "text": text, "user_id": user, "channel_id": CHANNEL, "team_id": "T1",
                          "response_url": f"{self.slack.url}/respond/{self._n}", "trigger_id": f"t{self._n}"})
        return await self.app.async_dispatch(self.signed(body, "application/x-www-form-urlencoded", **kw).bolt())

    async def event(self, event: dict, **kw):
        self._n += 1
        body = json.dumps({"type": "event_callback", "team_id": "T1", "api_app_id": "A1", "event_id": f"Ev{self._n}",
                           "event_time": int(time.time()), "event": event,
                           "authorizations": [{"user_id": "UBOT", "is_bot": True, "team_id": "T1"}]})
        return await self.app.async_dispatch(self.signed(body, "application/json", **kw).bolt())

    async def mention(self, user: str, text: str) -> str:
        """@bot text -> the ts of the answer the bot posted."""
        before = len(self.slack.of("chat.postMessage"))
        self._n += 1
        ts = f"1699999999.{self._n:06d}"
        await self.event({"type": "app_mention", "user": user, "text": f"<@UBOT> {text}", "channel": CHANNEL, "ts": ts})
        posts = await self.slack.wait_for("chat.postMessage", before + 1)
        await self.drain()
        return f"1700000000.{len(posts):06d}"

    async def reaction(self, user: str, ts: str, name: str, added: bool = True):
        return await self.event({"type": "reaction_added" if added else "reaction_removed", "user": user,
                                 "reaction": name, "item": {"type": "message", "channel": CHANNEL, "ts": ts},
                                 "item_user": "UBOT", "event_ts": str(time.time())})

    async def block_action(self, user: str, ts: str, action: dict):
        """``action`` taken on the blocks under the answer ``ts``, as Slack posts it."""
        self._n += 1
        payload = {"type": "block_actions", "user": {"id": user}, "team": {"id": "T1"}, "api_app_id": "A1",
                   "channel": {"id": CHANNEL}, "message": {"ts": ts, "text": "x"}, "container": {"type": "message"},
                   "trigger_id": f"t{self._n}", "response_url": f"{self.slack.url}/respond/{self._n}",
                   "actions": [{"block_id": "rl_rate", "action_ts": "1", **action}]}
        body = urlencode({"payload": json.dumps(payload)})
        return await self.app.async_dispatch(self.signed(body, "application/x-www-form-urlencoded").bolt())

    async def button(self, user: str, ts: str, action: str = GOOD_ACTION, value: str | None = None):
        return await self.block_action(user, ts, {"action_id": action, "type": "button",
                                                  "value": value or ("1" if action == GOOD_ACTION else "-1")})

    async def select_stars(self, user: str, ts: str, value: str):
        """The 1-5 stars control under an answer, an option chosen."""
        return await self.block_action(user, ts, {
            "action_id": STARS_ACTION, "type": "static_select",
            "selected_option": {"text": {"type": "plain_text", "text": "★"}, "value": value}})

    async def reply(self, n: int) -> str:
        """The text of the n-th private reply (to a command or button), working the queue meanwhile."""
        def got():
            replies = [c.body for c in self.slack.calls if c.path.startswith("/respond/")]
            return replies if len(replies) >= n else None

        replies = await self.base.until(got, f"reply {n}")
        assert replies[n - 1].get("response_type") == "ephemeral"
        return replies[n - 1]["text"]


@asynccontextmanager
async def rig(home, **slack_settings):
    async with FakeSlack() as slack, bot_rig("slack", **slack_settings) as base:
        yield SlackRig(base, build_app(base.core, "xoxb-test", SECRET, f"{slack.url}/api/"), slack)


def test_a_mention_is_answered_in_thread_with_buttons_and_captured(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "what is a monad?")
            post = r.slack.of("chat.postMessage")[-1]
            assert post["text"] == "answer to: what is a monad?"
            assert r.llm.scopes == [None]  # the default: the shared adapter answers, no scope asked for
            assert post["thread_ts"] == "1699999999.000001"
            actions = json.loads(post["blocks"]) if isinstance(post["blocks"], str) else post["blocks"]
            assert [e["action_id"] for e in actions[1]["elements"]] == ["rl_good", "rl_bad", "rl_stars"]
            with r.store.session() as s:
                cap = s.scalars(select(CaptureRow)).one()
                assert (cap.source, cap.conversation, cap.message_ref, cap.owner) == ("slack", CHANNEL, ts, OWNER)
                assert cap.prompt[-1] == {"role": "user", "content": "what is a monad?"}
                assert cap.behaviour_logprobs == [-0.5] * len(post["text"].split())  # ours: kept
                assert cap.finish_reason == "stop"
    run(go())


def test_buttons_can_be_switched_off_and_a_foreign_responder_keeps_no_logprobs(queued_home):
    async def go():
        async with rig(queued_home, buttons=False) as r:
            r.llm.ours = False
            r.llm.finish_reason = "length"  # its max_tokens cut the answer off
            await r.mention(OWNER, "hello")
            assert "blocks" not in r.slack.of("chat.postMessage")[-1]
            r.llm.finish_reason = "sideways"  # a word nobody defined: not known, not an error
            await r.mention(OWNER, "hello again")
            with r.store.session() as s:
                caps = s.scalars(select(CaptureRow).order_by(CaptureRow.created)).all()
                assert [(c.behaviour_logprobs, c.model) for c in caps] == [(None, "tiny")] * 2
                assert [c.finish_reason for c in caps] == ["length", None]
    run(go())


def test_rl_good_bad_undo_by_the_owner(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            await r.command(OWNER, "good crisp")
            assert (await r.reply(1)).startswith("rated good")
            await r.command(OWNER, "bad")
            assert (await r.reply(2)).startswith("re-rated bad")
            await r.command(OWNER, "undo")
            assert (await r.reply(3)) == "undid your bad rating"
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "undone")]
    run(go())


def test_with_person_scopes_each_asker_is_answered_by_and_rates_into_their_own_scope(queued_home):
    from rlfleet.shared import scopes
    from rlfleet.shared.ingress.replies import admins_only
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.schema import RatingRow

    async def go():
        async with rig(queued_home, scope="person") as r:
            await r.mention(OWNER, "q1")
            assert r.llm.scopes == [f"person:slack:{OWNER}"]  # rlfleet serve answers with their adapter
            await r.command(OWNER, "good crisp")
            assert (await r.reply(1)).startswith("rated good")
            with r.store.session() as s:
                (rating,) = s.scalars(select(RatingRow)).all()
            assert rating.train_model == scopes.lineage(model_slug(r.cfg.model), f"person:slack:{OWNER}")
            # their own adapter is theirs to run, no admin needed: train, status, then the cooldown
            await r.command(OWNER, "train")
            assert "training run" in await r.reply(2)  # their 1 pending rating, in their own scope
            assert r.handle.train.count == 1 and f"person_slack_{OWNER}" in r.handle.train.job_ids[0]
            await r.command(OWNER, "status")
            assert (await r.reply(3)).startswith("your adapter: serving the base model")
            await r.command(OWNER, "rollback")
            assert (await r.reply(4)).startswith("one command per")
            # anyone else's adapter is the admins': named by its scope
            await r.command(RATER, f"reset person:slack:{OWNER}")
            assert await r.reply(5) == admins_only("reset")
            await r.command(ADMIN, "reset person:myspace:x")
            assert "is not a scope" in await r.reply(6)
            await r.command(ADMIN, f"reset person:slack:{OWNER}")
            assert (await r.reply(7)).startswith("reset to the base model")
            owner_lineage = scopes.lineage(model_slug(r.cfg.model), f"person:slack:{OWNER}")
            assert r.store.baseline(owner_lineage)[1] == 1  # a fresh lineage of OWNER's adapter
            assert r.store.baseline(model_slug(r.cfg.model))[1] == 0  # the shared one untouched
    run(go())


def test_in_a_channel_scope_the_channels_adapter_answers_and_only_admins_run_it(queued_home):
    from rlfleet.shared.ingress.replies import admins_only

    async def go():
        async with rig(queued_home, scope="person", channel_scopes={CHANNEL: "channel"}) as r:
            await r.mention(OWNER, "q1")
            assert r.llm.scopes == [f"channel:slack:{CHANNEL}"]
            await r.command(OWNER, "good")
            assert (await r.reply(1)).startswith("rated good")
            await r.command(OWNER, "train")
            assert await r.reply(2) == admins_only("train")
            await r.command(ADMIN, "train")
            assert "training run" in await r.reply(3)  # the channel's one pending rating, its own run
            assert f"channel_slack_{CHANNEL}" in r.handle.train.job_ids[0]
            await r.command(OWNER, "status")
            assert (await r.reply(4)).startswith("this channel's adapter: serving the base model")
    run(go())


def test_a_comment_with_the_word_payload_is_a_comment(queued_home):
    """Bolt reads a form body holding "payload" as an interactive payload; the command still arrives."""
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            assert (await r.command(OWNER, "bad the payload is wrong")).status == 200
            assert (await r.reply(1)).startswith("rated bad")
            assert r.ratings() == [(OWNER, -1, "active")]
    run(go())


def test_rl_stars_rate_through_the_slash_command(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            await r.command(OWNER, "4 close")
            assert (await r.reply(1)).startswith("rated good (4★)")
            await r.command(OWNER, "6")
            assert "unknown command '6'" in await r.reply(2)
            assert r.ratings() == [(OWNER, 1, "active")]
            with r.store.session() as s:
                assert s.scalars(select(RatingRow)).one().stars == 4
    run(go())


def test_the_stars_control_under_an_answer_rates_in_stars(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            post = r.slack.of("chat.postMessage")[-1]
            blocks = post["blocks"] if isinstance(post["blocks"], list) else json.loads(post["blocks"])
            (control,) = [e for e in blocks[1]["elements"] if e["action_id"] == STARS_ACTION]
            assert [o["value"] for o in control["options"]] == ["5", "4", "3", "2", "1"]
            await r.select_stars(OWNER, ts, "5")
            assert (await r.reply(1)).startswith("rated good (5★)")
            await r.select_stars(STRANGER, ts, "1")
            assert await r.reply(2) == NOT_YOURS
            await r.select_stars(OWNER, ts, "9")  # not an option we sent
            assert await r.reply(3) == "not a star rating (1-5)"
            await r.select_stars(OWNER, ts, "2")  # a 👎 in stars offers the reasons, as the 👎 button does
            offer = await r.base.until(lambda: [c.body for c in r.slack.calls if c.path.startswith("/respond/")][3:],
                                       "the reasons offered")
            assert offer[0]["text"].startswith("re-rated bad (2★)") and "blocks" in offer[0]
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            with r.store.session() as s:
                assert [row.stars for row in s.scalars(select(RatingRow).order_by(RatingRow.id))] == [5, 2]
    run(go())


def test_rl_why_gives_the_last_rating_its_reason(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            await r.command(OWNER, "why too long")
            assert "nothing you rated here yet" in await r.reply(1)
            await r.command(OWNER, "bad")
            assert (await r.reply(2)).startswith("rated bad")
            await r.mention(OWNER, "q2")  # a newer answer, not rated: the reason still goes to q1's rating
            await r.command(OWNER, "why")
            assert (await r.reply(3)).startswith("say why after /rl why")
            await r.command(OWNER, "why too long")
            assert await r.reply(4) == "noted why it is bad: too long"
            assert r.ratings() == [(OWNER, -1, "replaced"), (OWNER, -1, "active")]
            with r.store.session() as s:
                assert s.scalars(select(RatingRow).where(RatingRow.state == "active")).one().comment == "too long"
    run(go())


def test_a_thumbs_down_button_offers_the_reasons_and_one_click_gives_it(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            await r.button(OWNER, ts, GOOD_ACTION)
            assert (await r.reply(1)).startswith("rated good")
            assert "blocks" not in [c.body for c in r.slack.calls if c.path.startswith("/respond/")][0]
            await r.button(OWNER, ts, BAD_ACTION)
            assert (await r.reply(2)).startswith("re-rated bad")
            offered = [c.body for c in r.slack.calls if c.path.startswith("/respond/")][1]
            blocks = json.loads(offered["blocks"]) if isinstance(offered["blocks"], str) else offered["blocks"]
            buttons = blocks[1]["elements"]
            assert [b["text"]["text"] for b in buttons] == list(REASONS)
            assert {b["value"] for b in buttons} == {ts}  # each one names the answer it is about
            await r.button(STRANGER, ts, buttons[0]["action_id"], value=ts)  # not theirs to give a reason for
            assert await r.reply(3) == NOT_YOURS
            await r.button(OWNER, ts, buttons[0]["action_id"], value=ts)
            assert await r.reply(4) == "noted why it is bad: too long"
            assert [c.body.get("replace_original") for c in r.slack.calls if c.path.startswith("/respond/")][3]
            await r.button(OWNER, ts, "rl_why_99", value=ts)  # a forged choice: said, nothing changed
            assert "not a reason of the menu" in await r.reply(5)
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "replaced"), (OWNER, -1, "active")]
            with r.store.session() as s:
                assert s.scalars(select(RatingRow).where(RatingRow.state == "active")).one().comment == "too long"
    run(go())


def test_rl_good_from_someone_the_bot_did_not_answer_changes_nothing(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            await r.command(STRANGER, "good")
            assert "nothing of yours to rate here" in await r.reply(1)
            await r.command(OWNER, "frobnicate")
            assert "unknown command 'frobnicate'" in await r.reply(2)
            assert r.ratings() == []
    run(go())


def test_reactions_rate_rerate_and_undo(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            await r.reaction(OWNER, ts, "+1::skin-tone-3")
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "active")]
            await r.reaction(OWNER, ts, "thumbsdown")  # changed her mind: re-rate
            await r.drain()
            await r.reaction(OWNER, ts, "+1", added=False)  # removing the old 👍 leaves the 👎
            await r.drain()
            assert r.ratings() == [(OWNER, 1, "replaced"), (OWNER, -1, "active")]
            await r.reaction(OWNER, ts, "-1", added=False)
            await r.drain()
            assert r.ratings()[-1] == (OWNER, -1, "undone")
    run(go())


def test_a_thumbs_down_reaction_offers_the_reasons_to_whoever_reacted(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            await r.reaction(OWNER, ts, "+1")  # a 👍 asks nothing
            await r.reaction(STRANGER, ts, "-1")  # nor a reaction that did not count
            await r.drain()
            assert r.slack.of("chat.postEphemeral") == []
            await r.reaction(OWNER, ts, "thumbsdown")
            (offer,) = await r.slack.wait_for("chat.postEphemeral", 1)
            assert (offer["channel"], offer["user"]) == (CHANNEL, OWNER)
            blocks = offer["blocks"] if isinstance(offer["blocks"], list) else json.loads(offer["blocks"])
            buttons = blocks[1]["elements"]
            assert [b["text"]["text"] for b in buttons] == list(REASONS) and {b["value"] for b in buttons} == {ts}
            await r.drain()
            await r.button(OWNER, "1700000000.999999", action=buttons[0]["action_id"], value=ts)  # "too long"
            assert await r.reply(1) == "noted why it is bad: too long"
            with r.store.session() as s:
                active = s.scalars(select(RatingRow).where(RatingRow.state == "active")).one()
                assert (active.value, active.comment) == (-1, "too long")
    run(go())


def test_reactions_that_must_not_count_are_ignored_silently(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            await r.reaction(STRANGER, ts, "+1")  # not theirs
            await r.reaction(OWNER, "1699999999.000001", "+1")  # the user's own message, not our answer
            await r.reaction(OWNER, ts, "tada")  # not a thumb
            await asyncio.sleep(0.2)
            assert r.queued() == 0 and r.ratings() == []
            await r.reaction(RATER, ts, "-1")  # an allowlisted rater counts
            await r.drain()
            assert r.ratings() == [(RATER, -1, "active")]
            assert not [c for c in r.slack.calls if c.path.startswith("/respond/")]  # no replies to reactions
    run(go())


def test_buttons_follow_the_same_owner_rules(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            await r.button(STRANGER, ts)
            assert "only the person the bot answered" in await r.reply(1)
            await r.button(OWNER, ts)
            assert (await r.reply(2)).startswith("rated good")
            assert r.ratings() == [(OWNER, 1, "active")]
    run(go())


def test_admin_commands_need_the_allowlist_and_a_cooldown(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.command(OWNER, "train")
            assert await r.reply(1) == "/rl train is for admins only"
            assert r.queued() == 0
            await r.command(ADMIN, "rollback")
            assert "already on the base model" in await r.reply(2)
            await r.command(ADMIN, "reset")
            assert "one admin command per 30 s" in await r.reply(3)
    run(go())


def test_forged_stale_and_malformed_requests_change_nothing(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            calls = len(r.slack.calls)
            assert (await r.command(OWNER, "good", secret="not-the-secret")).status == 401
            assert (await r.command(OWNER, "good", ts=int(time.time()) - 600)).status == 401
            forged = r.signed(json.dumps({"type": "event_callback", "event": {
                "type": "reaction_added", "user": OWNER, "reaction": "+1",
                "item": {"type": "message", "channel": CHANNEL, "ts": ts}}}), "application/json", secret="nope")
            assert (await r.app.async_dispatch(forged.bolt())).status == 401
            for actions in ([3], [], [{"value": "1"}], "rl_good"):  # what bolt's own matching cannot read
                press = urlencode({"payload": json.dumps({"type": "block_actions", "user": {"id": OWNER},
                                                          "actions": actions})})
                resp = await r.app.async_dispatch(r.signed(press, "application/x-www-form-urlencoded").bolt())
                assert resp.status == 400 and "malformed" in resp.body, (actions, resp.status)
            await asyncio.sleep(0.2)
            assert r.queued() == 0 and r.ratings() == [] and len(r.slack.calls) == calls
    run(go())


def test_http_mode_serves_bolt_on_loopback_and_refuses_malformed_bodies(queued_home):
    async def go():
        async with rig(queued_home) as r:
            async with listening(http_app(r.app), "127.0.0.1", 0) as port:
                url = f"http://127.0.0.1:{port}/slack/events"
                async with aiohttp.ClientSession() as http:
                    signed = r.signed("{not json", "application/json")
                    async with http.post(url, data="{not json", headers=signed.headers) as resp:
                        assert resp.status == 400 and (await resp.json()) == {"error": "malformed payload"}
                    async with http.post(url, data=b"x" * (2 << 20)) as resp:
                        assert resp.status == 413
                    body = urlencode({"command": "/rl", "text": "status", "user_id": OWNER, "channel_id": CHANNEL,
                                      "response_url": f"{r.slack.url}/respond/1", "team_id": "T1"})
                    req = r.signed(body, "application/x-www-form-urlencoded")
                    async with http.post(url, data=body, headers=req.headers) as resp:
                        assert resp.status == 200
                assert "no status yet" in await r.reply(1)
                assert r.queued() == 0
    run(go())


def test_a_restarted_bot_still_knows_its_answers(queued_home):
    async def go():
        async with rig(queued_home) as r:
            ts = await r.mention(OWNER, "q1")
            r.handle.redis.delete("rlfleet:posted:slack")  # a Redis that kept nothing
            fresh = BotCore("slack", r.cfg, r.handle, Store(r.cfg.db_url), wait_s=0.2)
            assert fresh.posted.lookup("slack", CHANNEL, ts).owner == OWNER  # from the store
            assert fresh.posted.lookup("discord", CHANNEL, ts) is None  # another platform's refs are not ours
    run(go())


def test_status_reads_the_workers_snapshot(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.command(OWNER, "status")
            assert "no status yet" in await r.reply(1)
            await r.mention(OWNER, "q1")  # the worker publishes a snapshot after every event
            await r.command(OWNER, "status")
            text = await r.reply(2)
            assert "serving the base model" in text and "0/32 toward the next training run" in text
    run(go())


def test_a_reply_in_its_thread_is_answered_with_the_thread_as_context(queued_home):
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "what is a monad?")
            thread = r.slack.of("chat.postMessage")[-1]["thread_ts"]
            r.slack.thread = [
                {"ts": thread, "user": OWNER, "text": "<@UBOT> what is a monad?"},
                {"ts": "1700000000.000001", "user": "UBOT", "bot_id": "BBOT", "text": "answer to: what is a monad?"},
            ]
            before = len(r.slack.of("chat.postMessage"))
            await r.event({"type": "message", "channel_type": "channel", "user": OWNER, "channel": CHANNEL,
                           "text": "and in Haskell?", "ts": "1700000005.000000", "thread_ts": thread})
            await r.slack.wait_for("chat.postMessage", before + 1)
            assert r.llm.of("/chat/completions")[-1]["messages"] == [
                {"role": "user", "content": "what is a monad?"},
                {"role": "assistant", "content": "answer to: what is a monad?"},
                {"role": "user", "content": "and in Haskell?"},
            ]
            await r.event({"type": "message", "channel_type": "channel", "user": STRANGER, "channel": CHANNEL,
                           "text": "unrelated chatter", "ts": "1700000006.000000"})  # not its thread: silence
            await asyncio.sleep(0.2)
            assert len(r.slack.of("chat.postMessage")) == before + 1
    run(go())


def test_a_thread_longer_than_the_model_reads_is_answered_on_its_latest_turns(queued_home):
    """The responder refuses a conversation past its context (400 context_length_exceeded, as OpenAI and
    `rlfleet serve` do): the earliest turns go until it fits, and that is the prompt captured; a message
    too long alone gets one line saying so, and nothing is captured."""
    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "start")
            thread = r.slack.of("chat.postMessage")[-1]["thread_ts"]
            r.slack.thread = [{"ts": thread, "user": OWNER, "text": "<@UBOT> " + "old words " * 30},
                              {"ts": "1700000000.000001", "user": "UBOT", "bot_id": "BBOT", "text": "x" * 200},
                              {"ts": "1700000000.000002", "user": OWNER, "text": "the recent question"},
                              {"ts": "1700000000.000003", "user": "UBOT", "bot_id": "BBOT", "text": "recent answer"}]
            r.llm.context_chars = 120
            before, asked = len(r.slack.of("chat.postMessage")), len(r.llm.of("/chat/completions"))
            await r.event({"type": "message", "channel_type": "channel", "user": OWNER, "channel": CHANNEL,
                           "text": "and now?", "ts": "1700000005.000000", "thread_ts": thread})
            posts = await r.slack.wait_for("chat.postMessage", before + 1)
            assert posts[-1]["text"] == "answer to: and now?"
            fitted = [{"role": "user", "content": "the recent question"},
                      {"role": "assistant", "content": "recent answer"}, {"role": "user", "content": "and now?"}]
            tried = [c["messages"] for c in r.llm.of("/chat/completions")[asked:]]
            # the whole thread, then without its first turn and the answer that would open it: it fits
            assert len(tried) == 2 and len(tried[0]) == 5 and tried[1] == fitted
            await r.base.until(lambda: any(c.prompt[-1]["content"] == "and now?" for c in r.base.captures()), "capture")
            capture = next(c for c in r.base.captures() if c.prompt[-1]["content"] == "and now?")
            assert [m["content"] for m in capture.prompt] == [m["content"] for m in fitted]  # what it answered on
            n = len(r.base.captures())
            await r.event({"type": "message", "channel_type": "channel", "user": OWNER, "channel": CHANNEL,
                           "text": "y" * 500, "ts": "1700000006.000000", "thread_ts": thread})
            posts = await r.slack.wait_for("chat.postMessage", before + 2)
            assert posts[-1]["text"].startswith("(no answer: the message is longer than the model reads at once")
            await r.drain()
            assert len(r.base.captures()) == n
    run(go())


@pytest.mark.parametrize("status, body, refused", [
    (400, {"error": {"message": "This model's maximum context length is 8192 tokens.", "type":
                     "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}, True),  # OpenAI
    (400, {"object": "error", "message": "This model's maximum context length is 2048 tokens. However, you "
           "requested 3000 tokens", "type": "BadRequestError", "param": None, "code": 400}, True),  # vLLM
    (400, {"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it",
                     "type": "exceed_context_size_error", "n_prompt_tokens": 5000, "n_ctx": 4096}}, True),  # llama.cpp
    (400, {"error": {"message": "temperature must be at most 2", "type": "invalid_request_error"}}, False),
    (500, {"error": {"message": "maximum context length", "code": "context_length_exceeded"}}, False),
    (400, "not json", False),
])
def test_each_servers_refusal_of_a_long_conversation_is_told_apart(status, body, refused):
    from rlfleet.bots.completions import context_refusal

    said = context_refusal(status, body if isinstance(body, str) else json.dumps(body))
    assert (said is not None) == refused and (said is None or "context" in said)


def test_socket_mode_acks_envelopes_and_works_after_the_ack(queued_home):
    """The default connection: bolt's Socket Mode handler opens the websocket our fake hands out, acks
    a slash-command envelope, and answers through response_url afterwards."""
    from slack_bolt.adapter.socket_mode.aiohttp import AsyncSocketModeHandler

    async def go():
        async with rig(queued_home) as r:
            await r.mention(OWNER, "q1")
            handler = AsyncSocketModeHandler(r.app, "xapp-test")
            await handler.connect_async()
            try:
                await r.base.until(lambda: r.slack.socket, "the socket connection")
                assert r.slack.of("apps.connections.open")
                await r.slack.socket.send_str(json.dumps({
                    "envelope_id": "env-1", "type": "slash_commands", "accepts_response_payload": True,
                    "payload": {"command": "/rl", "text": "good via socket", "user_id": OWNER,
                                "channel_id": CHANNEL, "team_id": "T1", "trigger_id": "t",
                                "response_url": f"{r.slack.url}/respond/1"}}))
                await r.base.until(lambda: r.slack.acks, "the envelope's ack")
                assert r.slack.acks[0]["envelope_id"] == "env-1"
                assert (await r.reply(1)).startswith("rated good")
                assert r.ratings() == [(OWNER, 1, "active")]
            finally:
                await handler.close_async()
    run(go())
