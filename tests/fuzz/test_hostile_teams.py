"""Hostile activities through botbuilder's CloudAdapter behind the real aiohttp ``/api/messages``: `/rl`
text, card buttons and reactions from people who may not rate, other activity types, mutated shapes
and bodies of any JSON; then forged, stale and missing ``Authorization`` headers with Bot Framework
authentication on, verified against signing keys served on 127.0.0.1.

Properties: no 500 and no failed turn (the adapter reports a crash of our handler only in the log);
nobody who may not rate changes a row and nobody is answered, even after the real worker has applied
every queued event; the bot still takes the owner's 👍 afterwards; with authentication on, every request
without a genuine token is a 401 that changes nothing while the same activity with a genuine token
counts; every reply is a plain message; no secret in a reply, a request or a log line; nothing leaves
127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("botbuilder.core")
import jwt  # noqa: E402
from botfakes import FakeBotFrameworkKeys, in_thread  # noqa: E402
from botframework.connector.auth import AuthenticationConstants, ChannelValidation, JwtTokenExtractor  # noqa: E402
from botrig import ADMIN, OWNER, RATER, STRANGER, LiveWorker, held  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import rsa  # noqa: E402
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
from test_bot_teams import CONV, rig  # noqa: E402

from rlfleet.bots.completions import Completion  # noqa: E402

APP_ID = "00000000-0000-0000-0000-0000000000aa"
PASSWORD = "FUZZ-TEAMS-APP-PASSWORD-0123456789"
ANSWER = "{answer}"  # the id of the bot's answer, known once the case runs
NOBODY_ALLOWED = {OWNER: STRANGER, RATER: STRANGER, ADMIN: STRANGER}
OK = {200, 201, 202}

actors = st.sampled_from([STRANGER, "777", "", "29:1001"]) | st.integers(0, 2**64).map(str) | odd_text
actions = st.sampled_from(["good", "bad", "undo", "status", "train", "rollback", "reset", "help", "+1", ""]) | odd_text
thumbs = st.sampled_from(["like", "1f44d_thumbsup", "1f44e_thumbsdown_3", "heart"]) | odd_text
refs = st.sampled_from([ANSWER, ANSWER, "reply-99", ""]) | odd_text
# Conversation ids: botbuilder sends the id back in the reply's x-ms-conversation-id header, so the bot
# refuses one outside printable ASCII with a 400 (it failed the turn after a 201 before).
conversations = st.sampled_from(["19:elsewhere", "a:1Hk", "", "x" * 300]) | st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300) | odd_text


def _sender(draw) -> dict:
    user = draw(actors)
    account = {"id": f"29:{user}", "name": f"u{user}", "aadObjectId": user}
    if draw(st.integers(0, 4)) == 0:
        account["role"] = draw(st.sampled_from(["bot", "user", "skill"]))
    return account


@st.composite
def activities(draw) -> dict:
    kind = draw(st.sampled_from(["rl", "button", "reaction", "other"]))
    act = {"id": f"in-{draw(st.integers(0, 10**9))}", "channelId": draw(st.sampled_from(["msteams", "msteams",
                                                                                         "emulator", "slack"])),
           "serviceUrl": "{connector}", "from": _sender(draw), "recipient": {"id": "28:bot", "name": "rlfleet"},
           "conversation": {"id": CONV, "conversationType": draw(st.sampled_from(["channel", "personal",
                                                                                  "groupChat"]))}}
    keep: tuple[str, ...] = ()
    if kind == "rl":
        text = f"{draw(st.sampled_from(['/rl', '/RL', 'rl']))} {draw(actions)} {draw(odd_text)}".rstrip()
        act.update(type="message", text=text)
        if draw(st.booleans()):
            act["replyToId"] = draw(refs)
        if draw(st.booleans()):  # /rl somewhere the bot does not answer: any text may go there
            act["conversation"]["id"] = draw(conversations)
        else:
            keep = ("text",)  # in the bot's channel, a message that is not /rl would be a question
    elif kind == "button":
        act.update(type="message", replyToId=draw(refs),
                   value=draw(st.sampled_from([{"rl": 1}, {"rl": -1}, {"rl": 0}, {"rl": "1"}, {"rl": None}])
                              | st.dictionaries(st.just("rl"), json_values)))
        keep = ("text",)
    elif kind == "reaction":
        key = draw(st.sampled_from(["reactionsAdded", "reactionsRemoved"]))
        act.update({"type": "messageReaction", "replyToId": draw(refs),
                    key: [{"type": t} for t in draw(st.lists(thumbs, min_size=1, max_size=3))]})
    else:
        act.update(type=draw(st.sampled_from(["conversationUpdate", "invoke", "typing", "event", "endOfConversation",
                                              "installationUpdate", "messageUpdate", "messageDelete"]) | odd_text),
                   name=draw(odd_text), value=draw(json_values))
        act["conversation"]["id"] = draw(conversations)
    # The serviceUrl stays: with authentication off the bot replies wherever it says (the auth-on test
    # below proves a token must name it), and a reply to nowhere is no fault of the handler.
    keep += ("serviceUrl",)
    rate = draw(st.sampled_from([0, 0, 10, 40]))
    mutated = mutate(draw, {k: v for k, v in act.items() if k not in keep}, rate)
    return replace_values({**mutated, **{k: act[k] for k in keep if k in act}}, NOBODY_ALLOWED)


bodies = st.one_of(activities(), activities(), activities(), json_values)


@pytest.fixture
def loopback_only(monkeypatch) -> list[str]:
    """Every host name something tried to resolve that is not this machine (and the attempt fails)."""
    tried: list[str] = []
    real = socket.getaddrinfo

    def guarded(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else host
        if name not in (None, "127.0.0.1", "localhost", "::1"):
            tried.append(name)
            raise socket.gaierror(socket.EAI_NONAME, "tests stay on 127.0.0.1")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", guarded)
    return tried


def _filled(body, answer: str, connector: str):
    return replace_values(body, {ANSWER: answer, "{connector}": connector + "/"})


def _check_replies(calls, records) -> None:
    """What the bot sent the connector (``calls``) and logged (``records``): plain replies, no secret,
    no crash of ours."""
    for reply in [c.body for c in calls if "/activities" in c.path]:
        assert isinstance(reply.get("text"), str) and reply["text"].strip() and "Traceback" not in reply["text"], reply
    sent = [json.dumps(c.body, ensure_ascii=False) for c in calls]
    assert not secrets_in([PASSWORD, SECRET], sent, records)
    assert not our_crashes(records)  # "teams turn failed": our handler raised, the adapter hid it behind a 201


def _said(user: str, conversation: str = CONV, **fields) -> dict:
    return {"id": "in-x", "channelId": "msteams", "serviceUrl": "{connector}",
            "from": {"id": f"29:{user}", "name": "u", "aadObjectId": user},
            "recipient": {"id": "28:bot", "name": "rlfleet"},
            "conversation": {"id": conversation, "conversationType": "channel"}, **fields}


# What the fuzzer found, kept: /rl text that makes no valid event (the ValidationError escaped into the
# turn: no reply), and activities without a recipient or a conversation (the handler or its reply raised).
FOUND = [_said(STRANGER, type="message", text="/rl good nul\x00byte"),
         _said(STRANGER, "x" * 300, type="message", text="/rl bad"),
         _said("u" * 300, type="message", text="/rl undo"),
         {k: v for k, v in _said(STRANGER, type="message", text="/rl status").items() if k != "recipient"},
         {k: v for k, v in _said(STRANGER, type="message", value={"rl": 1}, replyToId=ANSWER).items()
          if k != "conversation"},
         # and in nightly mode: ids no reply can carry, a lone surrogate in a message id, a null reaction
         _said(STRANGER, "🙃", type="message", text="/rl dance"), _said(STRANGER, "[" * 77_768, type="message",
                                                                      text="/rl dance"),
         _said(STRANGER, type="messageReaction", replyToId="half \ud83d a pair", reactionsAdded=[{"type": "like"}]),
         _said(STRANGER, type="messageReaction", replyToId=ANSWER, reactionsRemoved=[None])]


def test_activities_from_anyone_change_nothing_and_the_bot_carries_on(queued_home, caplog, loopback_only):
    """Authentication off, as in the rig: every sender is who it says; what matters is what they may do.
    The bot answers only in CONV here, so nothing but the owner's question gets an answer. One bot takes
    every case, as it would in a team for months: the first failing case is the one to read."""
    with held(rig(queued_home, channels=[CONV])) as (r, step), LiveWorker(r.base.handle):
        answer = step(r.ask(OWNER, "q1"))  # /rl replies wait for the worker's verdict

        async def send(batch) -> None:
            for body in batch:
                async with r.http.post(r.url, data=json.dumps(_filled(body, answer, r.connector.url)),
                                       headers={"Content-Type": "application/json"}) as resp:
                    text = await resp.text()
                    assert resp.status in OK | {400, 401, 413, 501}, (resp.status, text, body)
                    assert resp.status != 501 or (isinstance(body, dict) and body.get("type") == "invoke")
            await r.base.settle()

        @batched()
        @given(batch=st.lists(bodies, min_size=BATCH, max_size=BATCH))
        @example(batch=FOUND + [_said(STRANGER, type="messageReaction", replyToId=ANSWER,
                                      reactionsAdded=[{"type": "like"}])] * 3)
        def case(batch):
            new = held_case(step, caplog, "Teams activities", batch, send, r.connector.calls)
            assert r.ratings() == [] and len(r.base.captures()) == 1
            assert len(r.base.llm.calls) == 1  # nobody else was answered
            _check_replies(new, caplog.records)
            assert not loopback_only, loopback_only

        case()
        step(r.react(OWNER, answer, "like"))  # and the owner still counts
        step(r.base.settle())
        assert r.ratings() == [(OWNER, 1, "active")]


# ---- authentication on ---------------------------------------------------------------------------------

CHANNEL_ISSUER = AuthenticationConstants.TO_BOT_FROM_CHANNEL_TOKEN_ISSUER
EMULATOR_ISSUER = "https://sts.windows.net/d6d49420-f39b-4df7-a1dc-d59a935871db/"
_KEYS = {name: rsa.generate_private_key(public_exponent=65537, key_size=2048)
         for name in ("channel", "slack-only", "emulator", "attacker")}


def _jwk(name: str, endorsements: list[str]) -> dict:
    return {**json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(_KEYS[name].public_key())), "kid": name,
            "use": "sig", "endorsements": endorsements}


JWKS = {"channel": {"keys": [_jwk("channel", ["msteams"]), _jwk("slack-only", ["slack"])]},
        "emulator": {"keys": [_jwk("emulator", [])]}}


def genuine_claims(service_url: str) -> dict:
    now = int(time.time())
    return {"iss": CHANNEL_ISSUER, "aud": APP_ID, "serviceurl": service_url, "nbf": now - 60, "iat": now - 60,
            "exp": now + 3600}


def token(claims: dict, key: str = "channel", kid: str | None = None, alg: str = "RS256") -> str:
    if alg == "none":
        return jwt.encode(claims, None, algorithm="none")
    if alg.startswith("HS"):
        return jwt.encode(claims, PASSWORD, algorithm=alg, headers={"kid": kid or key})
    return jwt.encode(claims, _KEYS[key], algorithm=alg, headers={"kid": kid or key})


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


class Forged:
    """One forged Authorization header, made when the case runs (a token's claims name the fake
    connector's URL, known only then); its repr says what it is, for a failing case's report."""

    def __init__(self, what: str, make) -> None:
        self.what, self.make = what, make

    def __repr__(self) -> str:
        return f"Forged({self.what!r})"


@st.composite
def forged_headers(draw) -> Forged:
    """Authorization headers a genuine Bot Framework connector would never send for this bot."""
    kind = draw(st.sampled_from(["none", "text", "bearer-text", "claims", "key", "alg", "shape", "emulator"]))
    if kind == "none":
        return Forged("no header", lambda url: {})
    if kind == "text":
        text = draw(header_text)
        return Forged(f"Authorization: {text}", lambda url: {"Authorization": text})
    if kind == "bearer-text":
        text = draw(header_text.filter(lambda s: s and " " not in s))
        return Forged(f"Bearer {text}", lambda url: {"Authorization": "Bearer " + text})
    if kind == "claims":  # signed with the genuine key, but the claims are not for us, or not now
        name = draw(st.sampled_from(["iss", "aud", "serviceurl", "exp", "nbf"]))
        value = draw(st.sampled_from([None, "", "https://api.botframework.com.evil", APP_ID[:-1] + "b",
                                      "http://127.0.0.1:9/"]))
        drop = name not in ("exp", "nbf") and draw(st.booleans())  # no exp at all is the issuer's call
        drop = drop or (name == "iss" and value is None)  # PyJWT will not even encode a null issuer

        def bad_claims(url: str) -> dict:
            claims = genuine_claims(url)
            if drop:
                del claims[name]
            else:
                claims[name] = {"exp": int(time.time()) - 3600, "nbf": int(time.time()) + 3600}.get(name, value)
            return {"Authorization": "Bearer " + token(claims)}
        return Forged(f"{name} {'dropped' if drop else 'wrong'}", bad_claims)
    if kind == "key":  # the right claims, the wrong key: an attacker's, or one endorsed for another channel
        key = draw(st.sampled_from(["attacker", "slack-only", "emulator"]))
        kid = draw(st.sampled_from([key, "channel", "unknown-kid"]))
        return Forged(f"signed by {key} as {kid}",
                      lambda url: {"Authorization": "Bearer " + token(genuine_claims(url), key, kid)})
    if kind == "alg":  # no signature, or HMAC keyed with something guessable
        alg = draw(st.sampled_from(["none", "HS256"]))
        return Forged(f"alg {alg}", lambda url: {"Authorization": "Bearer " + token(genuine_claims(url), alg=alg)})
    if kind == "emulator":  # the emulator's issuer, signed by the channel's key or an attacker's
        key = draw(st.sampled_from(["channel", "attacker"]))
        return Forged(f"emulator issuer, {key} key", lambda url: {"Authorization": "Bearer " + token(
            {**genuine_claims(url), "iss": EMULATOR_ISSUER, "ver": "1.0", "appid": APP_ID}, key)})
    shape = draw(st.sampled_from(["bearer {t}", "Bearer  {t}", "{t}", "Bearer {t} x", "Basic {t}", "Bearer {t}AAAA"]))
    return Forged(f"genuine token as {shape!r}",  # a genuine token presented the wrong way
                  lambda url: {"Authorization": shape.format(t=token(genuine_claims(url)))})


def _owner_acts(draw) -> dict:
    """What the owner may do: with a genuine token, each of these would count."""
    base = {"id": f"in-{draw(st.integers(0, 10**9))}", "channelId": "msteams", "serviceUrl": "{connector}",
            "from": {"id": f"29:{OWNER}", "name": "owner", "aadObjectId": OWNER},
            "recipient": {"id": "28:bot", "name": "rlfleet"},
            "conversation": {"id": CONV, "conversationType": "channel"}}
    return draw(st.sampled_from([
        {**base, "type": "messageReaction", "replyToId": ANSWER, "reactionsAdded": [{"type": "like"}]},
        {**base, "type": "message", "text": "/rl bad", "replyToId": ANSWER},
        {**base, "type": "message", "replyToId": ANSWER, "value": {"rl": -1}},
        {**base, "type": "message", "text": "a question the bot would answer"},
    ]))


@st.composite
def forged_requests(draw) -> tuple[dict, Forged]:
    return _owner_acts(draw), draw(forged_headers())


def test_forged_or_missing_authorization_is_401_and_changes_nothing(queued_home, monkeypatch, caplog, loopback_only):
    with in_thread(FakeBotFrameworkKeys(jwks=JWKS)) as keys:
        # botbuilder caches signing keys per metadata URL for the process: a fake on a port an earlier
        # test's fake had (the OS reuses ports) would never be asked
        monkeypatch.setattr(JwtTokenExtractor, "metadataCache", {})
        monkeypatch.setattr(ChannelValidation, "open_id_metadata_endpoint", keys.metadata_url("channel"))
        monkeypatch.setattr(AuthenticationConstants, "TO_BOT_FROM_EMULATOR_OPENID_METADATA_URL",
                            keys.metadata_url("emulator"))
        with held(rig(queued_home, app_id=APP_ID, password=PASSWORD)) as (r, step):
            service_url = r.connector.url + "/"
            r.base.core.capture(CONV, "reply-1", OWNER, [{"role": "user", "content": "q1"}],
                                Completion(text="a1", model="m"))  # an answer the bot posted earlier
            step(r.drain())

            statuses: list[int] = []

            async def send(batch) -> None:
                statuses.clear()
                for activity, forged in batch:
                    activity = _filled(activity, "reply-1", r.connector.url)
                    async with r.http.post(r.url, json=activity, headers=forged.make(service_url)) as resp:
                        statuses.append(resp.status)
                        assert "Traceback" not in await resp.text()
                await r.drain()

            @batched()
            @given(batch=st.lists(forged_requests(), min_size=BATCH, max_size=BATCH))
            def case(batch):
                held_case(step, caplog, "Teams forged tokens", batch, send, r.connector.calls)
                assert statuses == [401] * len(batch), statuses
                assert r.ratings() == [] and r.queued() == 0 and not r.connector.calls and not r.base.llm.calls
                _check_replies(r.connector.calls, caplog.records)
                assert not loopback_only, loopback_only

            case()
            # the owner with a genuine token counts: the 401s were for the tokens
            genuine = {"Authorization": "Bearer " + token(genuine_claims(service_url))}
            react = _filled(_said(OWNER, type="messageReaction", replyToId=ANSWER, reactionsAdded=[{"type": "like"}]),
                            "reply-1", r.connector.url)
            assert step(r.post(react, genuine)) in OK
            step(r.drain())
            assert r.ratings() == [(OWNER, 1, "active")]
        assert keys.calls, "botbuilder never asked the fake for its keys: the forged tokens were not checked"
