"""The bridge over real HTTP on 127.0.0.1 with the real queue and worker: the happy path ends as rows;
forged, stale, replayed, oversized, malformed and over-limit requests change nothing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
from rq import Queue, SimpleWorker
from sqlalchemy import func, select

from rlfleet.bridge.app import Key, make_app
from rlfleet.bridge.auth import sign
from rlfleet.bridge.client import BridgeClient, BridgeError
from rlfleet.shared import inbox
from rlfleet.shared.config import BridgeKey, load_config
from rlfleet.shared.events import parse_event
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import EVENTS_QUEUE, open_queue
from rlfleet.shared.schema import CaptureRow, RatingRow
from rlfleet.shared.store import Store
from rlfleet.shared.webserver import listening
from rlfleet.worker.orchestrate import rated_sample

SECRET, GATEWAY_SECRET = "s" * 64, "g" * 64


@contextmanager
def running(app):
    """The app on a free loopback port, on its own event loop in a thread (the client blocks)."""
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), None
    port: list[int] = []

    async def main():
        nonlocal stop
        stop = asyncio.Event()
        async with listening(app, "127.0.0.1", 0) as bound:
            port.append(bound)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


@pytest.fixture
def bridge(queued_home):
    cfg = load_config()
    cfg.bridge.rate_limit = 20
    cfg.bridge.keys = [BridgeKey(id="gateway", secret_env="UNUSED")]
    handle = open_queue(cfg)
    keys = {"local": Key("local", SECRET, True), "gateway": Key("gateway", GATEWAY_SECRET, False)}
    with running(make_app(cfg, handle, keys)) as url:
        yield cfg, handle, url
    handle.close()


def work(cfg, handle) -> None:
    SimpleWorker([Queue(EVENTS_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)


def while_working(cfg, handle, call):
    """``call()`` in a thread while the worker (which wants the main thread) applies what it enqueued."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        deadline = time.monotonic() + 5
        while not handle.waiting_events() and time.monotonic() < deadline:
            time.sleep(0.01)
        work(cfg, handle)
        return future.result(10)


def counts(cfg) -> tuple[int, int]:
    with Store(cfg.db_url).session() as s:
        return (s.scalar(select(func.count()).select_from(CaptureRow)),
                s.scalar(select(func.count()).select_from(RatingRow)))


def raw(url: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=body if method != "GET" else None, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_capture_rate_undo_end_as_rows_and_the_worker_answers(bridge):
    cfg, handle, url = bridge
    client = BridgeClient(url, SECRET)
    cap = client.capture("what is a monad?", "A monad is a monoid in the category of endofunctors.",
                         conversation="sess-1", message_ref="turn-1", source="claude-code")
    assert cap["ok"] and cap["capture_id"]
    work(cfg, handle)
    r = client.rate("turn-1", "good", conversation="sess-1", comment="precise")
    work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        row = s.scalars(select(CaptureRow)).one()
        assert (row.source, row.conversation, row.message_ref) == ("claude-code", "sess-1", "turn-1")
        assert row.owner == "local"
        rating = s.scalars(select(RatingRow)).one()
        assert (rating.value, rating.comment, rating.actor, rating.event_id) == (1, "precise", "local", r["event_id"])
    client.undo()
    work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        assert s.scalars(select(RatingRow)).one().state == "undone"
    assert client.status()["ratings"]["total"] == 0  # the worker's snapshot, read from Redis


def test_an_answer_a_length_cap_cut_off_trains_without_an_end_token(bridge):
    cfg, handle, url = bridge
    client = BridgeClient(url, SECRET)
    client.capture("explain monads", "A monad is a way to", message_ref="t-cut", finish_reason="max_tokens")
    client.capture("and functors?", "A functor maps arrows.", message_ref="t-end", finish_reason="end_turn")
    client.capture("and arrows?", "Arrows generalise functions.", message_ref="t-unknown")
    body = json.dumps({"prompt": "q", "response": "a", "finish_reason": "lenght"}).encode()
    status, reply = raw(url, "POST", "/v1/captures", body, sign(SECRET, "POST", "/v1/captures", body))
    assert status == 422 and "'lenght' is not one of stop" in reply["error"], reply
    work(cfg, handle)
    for ref in ("t-cut", "t-end", "t-unknown"):
        client.rate(ref, "good")
    work(cfg, handle)
    assert counts(cfg) == (3, 3)  # the refused capture enqueued nothing
    with Store(cfg.db_url).session() as s:
        pairs = s.execute(select(RatingRow, CaptureRow).join(CaptureRow, RatingRow.capture_id == CaptureRow.id)
                          .order_by(CaptureRow.message_ref)).all()
        assert [c.finish_reason for _, c in pairs] == ["length", "stop", None]
        samples = [rated_sample(r, c, cfg.model) for r, c in pairs]
    assert [smp.complete for smp in samples] == [False, True, True]


def test_a_reason_said_afterwards_by_message_ref_and_one_without_words(bridge):
    cfg, handle, url = bridge
    client = BridgeClient(url, SECRET)
    client.capture("explain monads", "A monad is a monoid.", conversation="s", message_ref="t-1")
    work(cfg, handle)
    client.rate("t-1", "bad", conversation="s")
    work(cfg, handle)
    with pytest.raises(BridgeError, match="say why after /rl why"):
        client.rate("t-1", None, conversation="s")  # a reason with no words, and no rating either
    answer = while_working(cfg, handle, lambda: client.rate("t-1", None, conversation="s", comment="too vague",
                                                           wait=5))
    assert answer["result"]["message"] == "noted why it is bad: too vague"
    with Store(cfg.db_url).session() as s:
        rows = s.scalars(select(RatingRow).order_by(RatingRow.id)).all()
        assert [(r.value, r.comment, r.state) for r in rows] == [(-1, None, "replaced"), (-1, "too vague", "active")]


def test_stars_rate_beside_the_thumb_and_a_contradiction_is_refused(bridge):
    cfg, handle, url = bridge
    client = BridgeClient(url, SECRET)
    client.capture("explain monads", "A monad is a monoid.", conversation="s", message_ref="t-1")
    client.capture("and functors?", "A functor maps arrows.", conversation="s", message_ref="t-2")
    work(cfg, handle)
    with pytest.raises(BridgeError, match="2 stars is a thumbs-down"):
        client.rate("t-1", "good", conversation="s", stars=2)
    with pytest.raises(BridgeError, match="less than or equal to 5"):
        client.rate("t-1", None, conversation="s", stars=6)
    answer = while_working(cfg, handle, lambda: client.rate("t-1", None, conversation="s", stars=5, wait=5))
    assert answer["result"]["message"].startswith("rated good (5★)")
    client.rate("t-2", "bad", conversation="s", stars=1, comment="wrong")
    work(cfg, handle)
    with Store(cfg.db_url).session() as s:
        rows = s.scalars(select(RatingRow).order_by(RatingRow.id)).all()
        assert [(r.value, r.stars, r.comment) for r in rows] == [(1, 5, None), (-1, 1, "wrong")]


def test_wait_returns_the_workers_answer(bridge):
    cfg, handle, url = bridge
    client = BridgeClient(url, SECRET)
    answer = while_working(cfg, handle, lambda: client.rate("last", "bad", conversation="nowhere", wait=5))
    assert answer["result"] == {"ok": False, "message": "nothing of yours to rate here: no captured answer yet"}


def test_forged_stale_replayed_and_unknown_key_requests_change_nothing(bridge):
    cfg, handle, url = bridge
    body = json.dumps({"prompt": "q", "response": "a"}).encode()
    path = "/v1/captures"
    cases = {
        "bad signature": sign("wrong-secret", "POST", path, body),
        "stale request": sign(SECRET, "POST", path, body, now=time.time() - 600),
        "unknown key": sign(SECRET, "POST", path, body, key="mallory"),
        "missing": {},
        # too many digits for a float, then for int() itself: unix seconds they are not
        "not unix seconds": {**sign(SECRET, "POST", path, body), "X-Rlfleet-Timestamp": "9" * 400},
        "not unix seconds ": {**sign(SECRET, "POST", path, body), "X-Rlfleet-Timestamp": "9" * 5000},
    }
    for why, headers in cases.items():
        status, reply = raw(url, "POST", path, body, headers)
        assert status == 401, (why, reply)
        assert set(reply) == {"error"} and "Traceback" not in reply["error"]
    other_path = sign(SECRET, "POST", "/v1/ratings", body)  # signed for another endpoint
    assert raw(url, "POST", path, body, other_path)[0] == 401
    good = sign(SECRET, "POST", path, body)
    assert raw(url, "POST", path, body, good)[0] == 202
    status, reply = raw(url, "POST", path, body, good)  # the same request again
    assert status == 401 and reply["error"] == "replayed request"
    assert handle.waiting_events() == 1
    work(cfg, handle)
    assert counts(cfg) == (1, 0)


def test_oversized_malformed_and_over_limit_requests(bridge):
    cfg, handle, url = bridge
    huge = json.dumps({"prompt": "q", "response": "x" * (2 << 20)}).encode()
    status, reply = raw(url, "POST", "/v1/captures", huge, sign(SECRET, "POST", "/v1/captures", huge))
    assert status == 413 and ("too large" in reply["error"] or "over" in reply["error"])
    for body, fragment in ((b"{nope", "invalid body"), (b'{"value": "meh"}', "value"),
                           (b'{"value": "good", "extra": 1}', "extra"), (b"[]", "invalid body"),
                           # JSON's true and 1.0 are 1 to a lax check: a 1-star thumbs-down from `true`
                           (b'{"value": true}', "not True"), (b'{"value": 1.0}', "not 1.0"),
                           (b'{"value": null, "stars": true}', "stars"), (b'{"value": null, "stars": "5"}', "stars")):
        status, reply = raw(url, "POST", "/v1/ratings", body, sign(SECRET, "POST", "/v1/ratings", body))
        assert status == 422 and fragment in reply["error"], (body, reply)
    assert handle.waiting_events() == 0

    def rate(i: int) -> int:
        body = json.dumps({"value": "good", "event_id": f"burst-{i}"}).encode()
        return raw(url, "POST", "/v1/ratings", body, sign(GATEWAY_SECRET, "POST", "/v1/ratings", body,
                                                          key="gateway"))[0]

    # side by side, so a slow machine still sends more than the limit within one second
    with ThreadPoolExecutor(10) as pool:
        statuses = list(pool.map(rate, range(60)))
    assert 429 in statuses and set(statuses) == {202, 429}
    assert handle.waiting_events() == statuses.count(202)  # refused requests enqueued nothing


def test_a_gateway_key_names_its_own_people_and_reaches_no_one_else(bridge):
    """A non-admin key may name the people it relays, but they are its own (``gateway:alice``): naming
    ``local`` or a chat platform's user id neither rates, re-rates, undoes nor plants an answer for
    them. An admin key still vouches for whoever it names."""
    cfg, handle, url = bridge
    owner, gateway = BridgeClient(url, SECRET), BridgeClient(url, GATEWAY_SECRET, key="gateway")
    owner.capture("owner q", "owner answer", message_ref="o-1")
    work(cfg, handle)
    owner.rate("o-1", "good", comment="mine")
    gateway.capture("alice q", "alice answer", message_ref="a-1", actor="alice")
    gateway.capture("planted q", "PLANTED", owner="local")
    work(cfg, handle)
    answers = [while_working(cfg, handle, lambda: gateway.rate("o-1", "bad", actor="local", wait=5)),
               while_working(cfg, handle, lambda: gateway.undo(actor="local", wait=5)),
               while_working(cfg, handle, lambda: gateway.rate("a-1", "good", actor="alice", wait=5))]
    assert [a["result"]["ok"] for a in answers] == [False, False, True], answers
    with Store(cfg.db_url).session() as s:
        caps = {c.response: (c.source, c.owner) for c in s.scalars(select(CaptureRow))}
        active = {(r.actor, r.value, r.comment, r.capture_id[:0]) for r in s.scalars(
            select(RatingRow).where(RatingRow.state == "active"))}
    assert caps == {"owner answer": ("bridge", "local"), "alice answer": ("bridge", "gateway:alice"),
                    "PLANTED": ("bridge", "gateway:local")}
    assert active == {("local", 1, "mine", ""), ("gateway:alice", 1, None, "")}
    # The owner's `last` is still their own answer, not the planted one.
    while_working(cfg, handle, lambda: owner.rate("last", "bad", wait=5))
    with Store(cfg.db_url).session() as s:
        (mine,) = s.scalars(select(RatingRow).where(RatingRow.state == "active", RatingRow.actor == "local"))
        assert s.get(CaptureRow, mine.capture_id).response == "owner answer" and mine.value == -1
    # An admin key names anyone.
    answer = while_working(cfg, handle, lambda: owner.rate("a-1", "bad", actor="gateway:alice", wait=5))
    assert answer["result"]["ok"], answer


@pytest.mark.parametrize("ids, fragment", [(["local"], "'local' is the data dir's own key"),
                                            (["gw", "ops", "gw"], "'gw' is given to more than one")])
def test_a_key_that_would_replace_another_is_a_config_error(home, ids, fragment):
    """Two keys of one id, or a key named like the data dir's own, would silently take the other's
    place (and ``local`` is an admin whatever the entry says): ``rlfleet bridge`` refuses the config."""
    import os
    import subprocess
    import sys

    entries = "".join(f'[[bridge.keys]]\nid = "{i}"\nsecret_env = "UNUSED"\n' for i in ids)
    (home / "config.toml").write_text(entries)
    res = subprocess.run([sys.executable, "-c", "from rlfleet.cli import main; main()", "bridge", "--port", "0"],
                         capture_output=True, text=True, timeout=60, env=os.environ.copy())
    assert res.returncode != 0 and fragment in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_admin_commands_need_an_admin_key(bridge):
    cfg, handle, url = bridge
    gateway = BridgeClient(url, GATEWAY_SECRET, key="gateway")
    with pytest.raises(BridgeError) as exc:
        gateway.command("reset")
    assert exc.value.status == 403 and "admin key" in exc.value.message
    assert handle.waiting_events() == 0
    answer = while_working(cfg, handle, lambda: BridgeClient(url, SECRET).command("rollback", wait=5))
    assert answer["result"]["message"] == "already on the base model: nothing to roll back"


def test_an_admin_key_pauses_and_resumes_training_and_no_other_key_or_name_does(bridge):
    cfg, handle, url = bridge
    store, slug = Store(cfg.db_url), model_slug(cfg.model)
    with pytest.raises(BridgeError) as exc:
        BridgeClient(url, GATEWAY_SECRET, key="gateway").command("pause")
    assert exc.value.status == 403 and handle.waiting_events() == 0
    with pytest.raises(BridgeError) as exc:
        BridgeClient(url, SECRET).command("hold")  # not a command: refused at the edge
    assert exc.value.status == 422 and handle.waiting_events() == 0
    for name, args, words in [("pause", {"for": "1h"}, "pause takes no argument for (it takes: scope)"),
                              ("rollback", {"verison": "v1"}, "rollback takes no argument verison"),
                              ("promote", {"version": "v1", "force": "yes"}, "promote's force must be true or false"),
                              ("reset", {"purge_ratings": 1}, "reset's purge_ratings must be true or false")]:
        with pytest.raises(BridgeError) as exc:  # an argument it would not read: refused, nothing queued
            BridgeClient(url, SECRET).command(name, **args)
        assert exc.value.status == 422 and words in exc.value.message and handle.waiting_events() == 0, name
    assert store.training_paused(slug) is False
    answer = while_working(cfg, handle, lambda: BridgeClient(url, SECRET).command("pause", wait=5))
    assert answer["result"]["message"].startswith("automatic training paused") and answer["result"]["paused"]
    assert store.training_paused(slug) is True
    assert BridgeClient(url, SECRET).status()["training"]["paused"] is True
    answer = while_working(cfg, handle, lambda: BridgeClient(url, SECRET).command("resume", wait=5))
    assert answer["result"]["message"] == "automatic training resumed; the next run starts after 32 more ratings"
    assert store.training_paused(slug) is False


def test_a_command_acts_as_its_key_not_as_the_actor_it_names(queued_home):
    cfg = load_config()
    handle = open_queue(cfg)
    keys = {"local": Key("local", SECRET, True), "ops": Key("ops", "o" * 64, True),
            "gateway": Key("gateway", GATEWAY_SECRET, False)}
    try:
        with running(make_app(cfg, handle, keys)) as url:
            body = json.dumps({"name": "train", "actor": "local", "source": "codex"}).encode()
            status, reply = raw(url, "POST", "/v1/commands", body, sign(GATEWAY_SECRET, "POST", "/v1/commands",
                                                                      body, key="gateway"))
            assert status == 403 and "key gateway is not one" in reply["error"]  # naming `local` changes nothing
            assert handle.waiting_events() == 0
            BridgeClient(url, "o" * 64, key="ops").command("rollback", version="base")
            [queued] = [parse_event(e) for e in handle.redis.lrange(inbox.INBOX, 0, -1)]
            assert (queued.type, queued.source, queued.actor, queued.args) == ("command", "bridge", "ops",
                                                                              {"version": "base"})
    finally:
        handle.close()


def test_health_and_openapi_need_no_auth(bridge):
    _, _, url = bridge
    with urllib.request.urlopen(url + "/health", timeout=5) as resp:
        assert json.loads(resp.read()) == {"ok": True}
    with urllib.request.urlopen(url + "/openapi.json", timeout=5) as resp:
        spec = json.loads(resp.read())
    assert {"/v1/captures", "/v1/ratings", "/v1/undo", "/v1/status", "/v1/commands"} <= set(spec["paths"])
    assert spec["components"]["schemas"]["RatingIn"]["properties"]["value"]


def test_a_gateway_key_reads_the_scopes_of_its_own_people_only():
    from rlfleet.bridge.app import visible_status

    status = {"ratings": {"total": 9}, "scopes": {k: {"ratings": {"total": 1}} for k in (
        "person:bridge:gateway:alice", "person:bridge:bob", "person:slack:U123", "channel:slack:C1",
        "person:bridge:other:gateway:x")}}
    seen = visible_status(status, Key("gateway", GATEWAY_SECRET, False))
    assert set(seen["scopes"]) == {"person:bridge:gateway:alice"} and seen["ratings"] == {"total": 9}
    assert visible_status(status, Key("local", SECRET, True)) == status  # an admin key reads everything
