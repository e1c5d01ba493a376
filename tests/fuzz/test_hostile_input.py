"""Hostile input, property-based: the bridge API, hook stdin, imported rating files and `/rl` text.

Nothing crashes a process, nothing changes state unless the request is valid and signed, every
rejection is a one-line JSON error, and the secret shows up in no reply and no log line. CI runs a
few hundred cases per surface; ``RLFLEET_FUZZ_EXAMPLES=10000`` is the nightly mode.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from pathlib import Path
from typing import get_args
from urllib.parse import urlencode

import aiohttp
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hostile import BATCH, SECRET, batched, fuzz, json_values, mutate, replace_values, tally  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from botrig import ADMIN, OWNER, RATER, STRANGER, LiveWorker, held  # noqa: E402
from test_bridge import running  # noqa: E402

from rlfleet.bridge import hook  # noqa: E402
from rlfleet.bridge.app import Key, make_app  # noqa: E402
from rlfleet.bridge.auth import sign  # noqa: E402
from rlfleet.shared import inbox  # noqa: E402
from rlfleet.shared.config import load_config  # noqa: E402
from rlfleet.shared.ingress.grammar import _PREFIX, _VERBS, Verb, parse_rl, reaction_value  # noqa: E402
from rlfleet.shared.queue import EVENTS_QUEUE, open_queue  # noqa: E402
from rlfleet.shared.ratings_io import ImportReport, read_jsonl  # noqa: E402

FUZZ = fuzz()
# Bodies shaped like the real ones, with the fields mutated: what a buggy or hostile gateway sends.
field_names = st.sampled_from(["prompt", "response", "conversation", "message_ref", "owner", "actor", "source",
                               "target", "value", "comment", "event_id", "name", "args", "model", "capture_id",
                               "extra"])
near_bodies = st.dictionaries(field_names, json_values, max_size=8)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory, redis_url):
    home = tmp_path_factory.mktemp("fuzz-home")
    os.environ["RLFLEET_HOME"] = str(home)
    os.environ["REDIS_URL"] = redis_url
    cfg = load_config(home)
    cfg.bridge.rate_limit = 1_000_000
    handle = open_queue(cfg)
    handle.redis.flushdb()
    keys = {"local": Key("local", SECRET, True)}
    with running(make_app(cfg, handle, keys)) as url:
        yield url, handle
    handle.redis.flushdb()
    handle.close()
    del os.environ["RLFLEET_HOME"], os.environ["REDIS_URL"]


def _post(url: str, path: str, body: bytes, headers: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _forget_events(handle) -> None:
    """Drop what the bridge accepted (and the drain queued for it): accepted events are not the point
    here, and nightly mode would pile up thousands."""
    handle.redis.delete(inbox.INBOX, inbox.OWNER, EVENTS_QUEUE)


PATHS = st.sampled_from(["/v1/captures", "/v1/ratings", "/v1/undo", "/v1/commands"])


@FUZZ
@given(path=PATHS, body=near_bodies | json_values, signed=st.booleans())
def test_bridge_rejects_or_accepts_cleanly(bridge, caplog, path, body, signed):
    url, handle = bridge
    raw = json.dumps(body).encode()
    headers = sign(SECRET, "POST", path, raw) if signed else {"X-Rlfleet-Signature": "sha256=00"}
    before = handle.waiting_events()
    with caplog.at_level(logging.DEBUG):
        status, text = _post(url, path, raw, headers)
    assert status in (202, 401, 403, 422), (status, text)
    reply = json.loads(text)
    assert SECRET not in text and all(SECRET not in r.getMessage() for r in caplog.records)
    if status == 202:
        assert signed and handle.waiting_events() == before + 1
    else:
        assert set(reply) == {"error"} and "\n" not in reply["error"] and handle.waiting_events() == before
    _forget_events(handle)
    tally("bridge requests", 1)


@FUZZ
@given(raw=st.binary(max_size=300) | near_bodies.map(lambda b: json.dumps(b).encode()))
def test_bridge_survives_arbitrary_bytes(bridge, raw):
    url, handle = bridge
    status, text = _post(url, "/v1/ratings", raw, sign(SECRET, "POST", "/v1/ratings", raw))
    assert status in (202, 422) or json.loads(text) == {"error": "replayed request"}  # the same bytes, same second
    assert "Traceback" not in text
    _forget_events(handle)
    tally("bridge raw bytes", 1)


@FUZZ
@given(agent=st.sampled_from(["claude-code", "codex"]), event=st.sampled_from(["prompt", "stop"]),
       payload=st.binary(max_size=200) | st.dictionaries(
           st.sampled_from(["session_id", "prompt", "last_assistant_message", "transcript_path", "turn_id",
                            "prompt_id", "hook_event_name"]), json_values, max_size=6).map(
           lambda d: json.dumps(d).encode()))
def test_hooks_never_fail_the_agent(tmp_path_factory, monkeypatch, agent, event, payload):
    home = tmp_path_factory.mktemp("hook-home")
    (home / "config.toml").write_text("[bridge]\nport = 9\n")  # nothing listens: everything spools
    (home / "secret").write_text(SECRET)
    monkeypatch.setenv("RLFLEET_HOME", str(home))
    stdin, stdout = io.TextIOWrapper(io.BytesIO(payload)), io.StringIO()
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert hook.main([agent, event]) == 0
    out = stdout.getvalue()
    if out:
        decision = json.loads(out)
        assert decision["decision"] == "block" and decision["reason"].startswith("rlfleet:")
    assert SECRET not in out
    log = home / "logs" / "hooks.log"
    assert not log.exists() or SECRET not in log.read_text()
    tally("hook stdin", 1)


@FUZZ
@given(lines=st.lists(st.binary(max_size=120) | near_bodies.map(lambda b: json.dumps(b).encode()), max_size=8))
def test_imported_rating_files_are_validated_line_by_line(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("import") / "ratings.jsonl"
    path.write_bytes(b"\n".join(x.replace(b"\n", b" ") for x in lines))
    report = ImportReport()
    valid = list(read_jsonl(path, report))
    assert valid == [] and report.skipped["invalid"] == sum(1 for x in lines if x.strip())
    assert all(e.startswith("line ") for e in report.errors)
    tally("imported rating files", 1)


@FUZZ
@given(text=st.text(max_size=300), name=st.text(max_size=30) | st.none())
def test_commands_and_reactions_parse_anything(text, name):
    cmd = parse_rl(text)
    assert cmd.verb in get_args(Verb)
    # Anything that is not a known spelling of a verb is help, never an action.
    if cmd.verb != "help" and cmd.stars is None:
        head = _PREFIX.sub("", text, count=1).strip().partition(" ")[0].lower()
        assert _VERBS.get(head) == cmd.verb
    assert reaction_value(name) in (1, -1, None)
    tally("/rl text and reaction names", 1)


# ---- the platforms: signed but hostile payloads through the SDKs' own dispatch --------------------------

GROUP = -100123  # test_bot_telegram's group chat
ANSWER_MESSAGE = "{answer message}"  # the whole Telegram message of that answer
ANSWER = "{answer}"  # stands for the owner's captured answer, known once the bot has given it
# Whoever may rate (the owner, the allowlisted rater and admin) never appears in a hostile payload.
NOBODY_ALLOWED = {OWNER: STRANGER, RATER: STRANGER, ADMIN: STRANGER}
strangers = st.sampled_from([STRANGER, "U-someone", "UBOT", "", "0"]) | st.text(max_size=12)
thumbs = st.sampled_from(["+1", "-1", "+1::skin-tone-3", "thumbsup", "thumbsdown", "👍"]) | st.text(max_size=20)
rl_texts = (st.sampled_from(["good", "bad", "undo", "status", "train", "rollback", "reset", "help"])
            | st.text(max_size=80)).flatmap(
    lambda t: st.sampled_from([t, f"{t} {ANSWER}", f"good {ANSWER} {t}", f"bad {t}"]))

slack_events = st.fixed_dictionaries({
    "type": st.sampled_from(["reaction_added", "reaction_removed", "message", "app_mention", "team_join"]),
}, optional={"user": strangers | st.none(), "reaction": thumbs,
             "item": st.dictionaries(st.sampled_from(["type", "channel", "ts"]), json_values, max_size=3)
             | st.fixed_dictionaries({"type": st.just("message"), "channel": st.sampled_from(["C1", "C2"]),
                                      "ts": st.just(ANSWER) | st.text(max_size=20)}),
             "channel": json_values, "ts": json_values, "subtype": json_values, "bot_id": json_values})


@st.composite
def slack_press(draw) -> dict:
    """A 👍/👎 button press under the owner's answer (or another message), by someone else."""
    from rlfleet.bots.slack import BAD_ACTION, GOOD_ACTION

    action = draw(st.sampled_from([GOOD_ACTION, BAD_ACTION, "rl_other"]) | st.text(max_size=10))
    payload = {"type": "block_actions", "user": {"id": draw(strangers)}, "team": {"id": "T1"}, "api_app_id": "A1",
               "channel": {"id": "C1"}, "message": {"ts": draw(st.just(ANSWER) | st.text(max_size=20)), "text": "x"},
               "container": {"type": "message"}, "trigger_id": "t", "response_url": "{respond}",
               "actions": [{"action_id": action, "block_id": "rl_rate", "type": "button",
                            "value": draw(st.sampled_from(["1", "-1", "0"])), "action_ts": "1"}]}
    return mutate(draw, payload, draw(st.sampled_from([0, 0, 10, 40])))


def test_slack_payloads_change_nothing_they_should_not(queued_home):
    """The owner has a captured answer; signed events of every listened-to type, reactions and button
    presses on that answer, and `/rl` with any text, all from anyone but the owner (and the allowlisted):
    nothing else is answered, captured or rated, and afterwards the owner's 👍 still counts."""
    from test_bot_slack import rig

    from rlfleet.bots.slack import http_app
    from rlfleet.shared.webserver import listening

    @asynccontextmanager
    async def served():
        async with rig(queued_home) as r, listening(http_app(r.app), "127.0.0.1", 0) as port:
            async with aiohttp.ClientSession() as http:
                yield r, f"http://127.0.0.1:{port}/slack/events", http

    ids = itertools.count()
    with held(served()) as ((r, url, http), step), LiveWorker(r.handle):
        answer = step(r.mention(OWNER, "q1"))
        mapping = {ANSWER: answer, "{respond}": f"{r.slack.url}/respond/fuzz"}

        async def post(body: str, content_type: str) -> None:
            async with http.post(url, data=body, headers=r.signed(body, content_type).headers) as resp:
                assert resp.status in (200, 400, 404), await resp.text()

        async def send(batch) -> None:
            events, presses, texts = batch
            for event in events:
                if event["type"] in ("message", "app_mention"):
                    event["bot_id"] = "B-other"  # another bot talking: never answered, never captured
                event = replace_values(replace_values(event, NOBODY_ALLOWED), mapping)
                await post(json.dumps({"type": "event_callback", "team_id": "T1", "event_id": f"Ev{next(ids)}",
                                       "event": event}), "application/json")
            for press in presses:
                press = replace_values(replace_values(press, NOBODY_ALLOWED), mapping)
                await post(urlencode({"payload": json.dumps(press)}), "application/x-www-form-urlencoded")
            for text in texts:
                who = replace_values(draw_stranger(text), NOBODY_ALLOWED)
                assert (await r.command(who, text.replace(ANSWER, answer))).status == 200
            await asyncio.sleep(0.05)
            await r.base.settle()

        @batched()
        @given(events=st.lists(slack_events, min_size=BATCH - 6, max_size=BATCH - 6),
               presses=st.lists(slack_press(), min_size=2, max_size=2),
               texts=st.lists(rl_texts, min_size=4, max_size=4))
        def case(events, presses, texts):
            step(send((events, presses, texts)))
            tally("Slack events, buttons and commands", len(events) + len(presses) + len(texts))
            assert r.ratings() == [] and len(r.base.captures()) == 1
            assert len(r.llm.calls) == 1  # nobody else got an answer

        case()
        step(r.reaction(OWNER, answer, "+1"))
        step(r.base.settle())
        assert r.ratings() == [(OWNER, 1, "active")]


def draw_stranger(text: str) -> str:
    """Someone who may not rate, picked by the text so a case stays reproducible."""
    return ["U-someone", STRANGER, "UBOT", "0"][len(text) % 4]


@st.composite
def telegram_hostile(draw) -> dict:
    """A reaction, a button press or `/rl` on the owner's answer, from someone else, then mutated."""
    user = draw(st.sampled_from([int(STRANGER), 777, 999, 0]) | st.integers(-2**40, 2**40))
    sender = {"id": user, "is_bot": draw(st.booleans()), "first_name": "x"}
    chat = {"id": draw(st.sampled_from([GROUP, GROUP, user])), "type": "supergroup"}
    kind = draw(st.sampled_from(["reaction", "press", "command"]))
    if kind == "reaction":
        emoji = st.sampled_from(["👍", "👎", "🔥"]).map(lambda e: {"type": "emoji", "emoji": e})
        update = {"message_reaction": {"chat": chat, "message_id": draw(st.just(ANSWER) | st.integers()), "date": 0,
                                       "user": sender, "old_reaction": draw(st.lists(emoji, max_size=2)),
                                       "new_reaction": draw(st.lists(emoji, max_size=2))}}
    elif kind == "press":
        update = {"callback_query": {"id": "cb", "chat_instance": "ci", "from": sender, "message": ANSWER_MESSAGE,
                                     "data": draw(st.sampled_from(["rl:1", "rl:-1", "rl:0", "x"]))}}
    else:
        text = "/rl " + draw(rl_texts)
        message = {"message_id": draw(st.integers(1, 10**6)), "date": 0, "text": text, "chat": chat, "from": sender,
                   "entities": [{"type": "bot_command", "offset": 0, "length": 3}]}
        if draw(st.booleans()):
            message["reply_to_message"] = ANSWER_MESSAGE
        update = {"message": message}
    return mutate(draw, update, draw(st.sampled_from([0, 0, 10, 40])))


telegram_updates = st.dictionaries(
    st.sampled_from(["update_id", "message", "message_reaction", "callback_query", "edited_message"]),
    json_values | st.fixed_dictionaries({"chat": st.fixed_dictionaries({"id": st.integers(), "type": st.just("group")}),
                                         "message_id": st.integers(), "date": st.integers(0, 2**31)},
                                        optional={"text": st.text(max_size=40), "data": st.text(max_size=10)}),
    max_size=4)


def test_telegram_webhook_takes_any_body_without_harm(queued_home):
    """The owner has a captured answer; any update body, and reactions, button presses and `/rl` on that
    answer from anyone but the owner: no rating and no other capture, and afterwards the owner's 👍 counts."""
    from test_bot_telegram import OWNER_ID, rig

    from rlfleet.bots.telegram import webhook_app
    from rlfleet.shared.webserver import listening

    @asynccontextmanager
    async def served():
        async with rig(queued_home) as r:
            await r.app.start()
            try:
                async with listening(webhook_app(r.app, "s3cret"), "127.0.0.1", 0) as port:
                    async with aiohttp.ClientSession() as http:
                        yield r, f"http://127.0.0.1:{port}/telegram", http
            finally:
                await r.app.stop()

    ids = itertools.count(10**6)
    allowed = {k: int(v) for k, v in NOBODY_ALLOWED.items()}
    with held(served()) as ((r, url, http), step), LiveWorker(r.base.handle):
        answer = step(r.ask(OWNER_ID, "q1"))
        mapping = {ANSWER: answer["message_id"], ANSWER_MESSAGE: answer}

        async def send(updates) -> None:
            for update in updates:
                update = replace_values(replace_values(update, allowed), mapping)
                if isinstance(update, dict) and "update_id" not in update:
                    update["update_id"] = next(ids)
                async with http.post(url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": "s3cret"}) as resp:
                    assert resp.status in (200, 400)
            await asyncio.sleep(0.05)  # the application's update queue
            await r.base.settle()

        @batched()
        @given(updates=st.lists(telegram_updates, min_size=BATCH // 2, max_size=BATCH // 2),
               hostile=st.lists(telegram_hostile(), min_size=BATCH // 2, max_size=BATCH // 2))
        def case(updates, hostile):
            step(send(updates + hostile))
            tally("Telegram webhook updates", len(updates) + len(hostile))
            r.errors.clear()  # PTB reports what it could not parse to the error handler: not a crash of ours
            assert r.ratings() == [] and len(r.base.captures()) == 1

        case()
        step(asyncio.sleep(0.3))  # anything the last updates set going
        step(r.base.settle())
        assert r.ratings() == [] and len(r.base.captures()) == 1
        step(r.react(OWNER_ID, answer, [], ["👍"]))
        step(r.base.until(r.ratings, "the owner's rating"))
        assert r.ratings() == [(OWNER, 1, "active")]
