"""Hostile gateway events through discord.py's real client: `/rl` interactions (app command and button)
with wrong choices, odd text and mutated shapes, reactions from people who may not rate, and payloads
of any shape for the events the bot listens to, pushed by the fake gateway of tests/botfakes.py.

Properties: the client's receive loop survives all of it (afterwards the owner's 👍 still counts and
`/rl status` still answers); nobody who may not rate changes a row, even after the real worker has
applied every queued event; every follow-up the bot sends is a plain message; and the bot token shows up
in no log line and no request body.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("discord")
from botfakes import _discord_user  # noqa: E402
from botrig import ADMIN, OWNER, RATER, STRANGER, LiveWorker, held  # noqa: E402
from hostile import (  # noqa: E402
    BATCH,
    SECRET,
    batched,
    held_case,
    json_values,
    mutate,
    odd_text,
    our_crashes,
    replace_values,
    secrets_in,
)
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_bot_discord import BOT, member, rig  # noqa: E402

TOKEN = "MTE5.FUZZ-DISCORD-BOT-TOKEN.0123456789"
ANSWER = "{answer}"  # stands for the id of the bot's answer, known once the case runs
# Whoever may rate (the owner, the allowlisted rater and admin) never appears in a hostile event.
NOBODY_ALLOWED = {OWNER: STRANGER, RATER: STRANGER, ADMIN: STRANGER}

actors = st.sampled_from([STRANGER, "777", BOT, "0", "18446744073709551615"]) | st.integers(0, 2**64).map(str)
actions = st.sampled_from(["good", "bad", "undo", "status", "train", "rollback", "reset", "help"]) | odd_text
thumbs = st.sampled_from(["👍", "👎", "👍🏿", "thumbsup", "-1"]) | odd_text
message_ids = st.sampled_from([ANSWER, "42", "0"]) | st.integers(0, 2**64).map(str)


@st.composite
def reaction(draw) -> tuple[str, dict]:
    user = draw(actors)
    data = {"user_id": user, "channel_id": draw(st.sampled_from(["222", "223"])), "message_id": draw(message_ids),
            "guild_id": "111", "emoji": {"id": None, "name": draw(thumbs)}, "type": 0, "burst": draw(st.booleans())}
    if draw(st.booleans()):
        data["member"] = member(user, bot=draw(st.booleans()))
    event = draw(st.sampled_from(["MESSAGE_REACTION_ADD", "MESSAGE_REACTION_REMOVE"]))
    return event, mutate(draw, data, draw(st.sampled_from([0, 0, 10, 40])))


def slash(user: str, iid: str, action: str, detail: str | None = None, name: str = "rl", bot: bool = False) -> dict:
    """INTERACTION_CREATE of ``/rl action [detail]`` in the guild channel."""
    options = [{"name": "action", "type": 3, "value": action}]
    if detail is not None:
        options.append({"name": "detail", "type": 3, "value": detail})
    return _interaction(user, iid, 2, {"id": "1", "name": name, "type": 1, "options": options}, None, bot)


def _interaction(user: str, iid: str, itype: int, data: dict, message: dict | None, bot: bool) -> dict:
    payload = {"id": iid, "application_id": BOT, "type": itype, "token": f"tok{iid}", "version": 1,
               "guild_id": "111", "channel_id": "222",
               "channel": {"id": "222", "type": 0, "guild_id": "111", "name": "general", "position": 0,
                           "permission_overwrites": []},
               "member": member(user, bot=bot), "data": data, "app_permissions": "0",
               "locale": "en-US", "guild_locale": "en-US", "entitlements": [], "authorizing_integration_owners": {},
               "context": 0, "attachment_size_limit": 26214400}
    if message is not None:
        payload["message"] = message
    return payload


@st.composite
def interaction(draw) -> tuple[str, dict]:
    user, iid = draw(actors), str(draw(st.integers(10**6, 10**9)))
    if draw(st.booleans()):  # the /rl app command
        payload = slash(user, iid, draw(actions), draw(st.none() | odd_text),
                        draw(st.sampled_from(["rl", "rl", "other"])), draw(st.booleans()))
        return "INTERACTION_CREATE", mutate(draw, payload, draw(st.sampled_from([0, 0, 5, 30])))
    # a rating button under an answer
    data = {"custom_id": draw(st.sampled_from(["rl:1", "rl:-1", "rl:0", "x"])), "component_type": 2}
    message = {"id": draw(message_ids), "channel_id": "222", "author": _discord_user(BOT, bot=True),
               "content": "an answer", "timestamp": "2026-11-23T00:00:00+00:00", "edited_timestamp": None,
               "tts": False, "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [],
               "embeds": [], "pinned": False, "type": 0, "flags": 0, "components": []}
    payload = _interaction(user, iid, 3, data, message, draw(st.booleans()))
    return "INTERACTION_CREATE", mutate(draw, payload, draw(st.sampled_from([0, 0, 5, 30])))


anything = st.tuples(
    st.sampled_from(["INTERACTION_CREATE", "MESSAGE_REACTION_ADD", "MESSAGE_REACTION_REMOVE",
                     "MESSAGE_REACTION_REMOVE_ALL", "MESSAGE_REACTION_REMOVE_EMOJI", "TYPING_START",
                     "GUILD_MEMBER_UPDATE", "NOT_AN_EVENT"]),
    json_values)
gateway_events = st.one_of(reaction(), interaction(), anything).map(
    lambda e: (e[0], replace_values(e[1], NOBODY_ALLOWED)))


# What the fuzzer found, kept: events discord.py cannot parse (they ended the client's receive loop),
# /rl text that makes no valid event (the ValidationError escaped: no reply, a traceback in the log), and
# an interaction with no member and no user (``interaction.user.id`` raised), and (nightly mode) one whose
# token is a list (answering it raised inside discord.py).
FOUND = [("MESSAGE_REACTION_ADD", {"user_id": STRANGER, "message_id": ANSWER, "emoji": {}, "type": 0}),
         ("MESSAGE_REACTION_REMOVE", {"user_id": STRANGER}), ("INTERACTION_CREATE", [True, False]),
         ("INTERACTION_CREATE", slash(STRANGER, "7001", "good", "nul\x00byte")),
         ("INTERACTION_CREATE", slash("9" * 300, "7002", "undo")),
         ("INTERACTION_CREATE", {k: v for k, v in slash(STRANGER, "7003", "good").items() if k != "member"}),
         ("INTERACTION_CREATE", {**slash(STRANGER, "7004", "status"), "token": [1, 2]})]


def test_gateway_events_from_anyone_change_nothing_and_never_stop_the_client(queued_home, monkeypatch, caplog):
    """One client takes every case's events, as a bot in a busy guild takes them for months: a case
    that breaks it fails every case after it, so the first failing one is the one to read."""
    with held(rig(queued_home, monkeypatch, token=TOKEN)) as (r, step), LiveWorker(r.base.handle):
        answer = step(r.ask(OWNER, "q1"))  # /rl replies wait for the worker's verdict, as beside `rlfleet up`

        async def send(events) -> None:
            for name, data in events:
                await r.fake.dispatch(name, replace_values(data, {ANSWER: answer}))
            await settled(r)

        @batched()
        @given(events=st.lists(gateway_events, min_size=BATCH, max_size=BATCH))
        @example(events=FOUND + [("TYPING_START", {})] * 3)
        def case(events):
            new = held_case(step, caplog, "Discord gateway events", events, send, r.fake.calls)
            assert r.ratings() == [] and len(r.base.captures()) == 1
            assert r.client.ws is not None and not r.client.is_closed()
            for c in new:
                if "/webhooks/" in c.path or c.path.endswith("/messages"):
                    assert isinstance(c.body.get("content"), str) and c.body["content"].strip(), c.body
                    assert "Traceback" not in c.body["content"]
            bodies = [json.dumps(c.body, ensure_ascii=False) for c in new]
            assert not secrets_in([TOKEN, SECRET], bodies, caplog.records)
            assert not our_crashes(caplog.records)

        case()
        # still listening after all of it: the owner's reaction counts and /rl answers
        step(r.react(OWNER, answer, "👍"))
        step(r.base.until(r.base.ratings, "the owner's rating"))  # a gateway event: handled when the client gets to it
        assert r.ratings() == [(OWNER, 1, "active")]
        assert step(r.rl(STRANGER, "status")).startswith(("serving", "no status yet"))
        assert len(r.base.llm.calls) == 1  # nobody else got an answer


async def settled(r) -> None:
    """Wait until the client has handled what the fake sent, the worker has applied what that queued, and
    the follow-ups of its verdicts are out (nothing new for a moment)."""
    quiet, seen = 0, -1
    while quiet < 3:
        await asyncio.sleep(0.05)
        await r.base.settle()
        quiet, seen = (quiet + 1, seen) if len(r.fake.calls) == seen else (0, len(r.fake.calls))
