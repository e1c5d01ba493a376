"""Crash and restart: SIGKILL `rlfleet bridge` at random moments while clients post signed ratings,
some asking to wait for the worker's answer (so a kill often lands after the rating was queued and
before the 2xx went out). Clients retry what got no answer with the same event id, as a gateway does,
and a few ratings acknowledged already are delivered again. Every rating acknowledged with a 2xx is in
the database exactly once. Bounded in time; prints its counts."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
import uuid

from chaosrig import env_for, free_port, kill9, spawn, stop, stored_counts, tail, worker

from rlfleet.bridge.client import BridgeClient, BridgeError
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message
from rlfleet.shared.inbox import result_key
from rlfleet.shared.queue import open_queue
from rlfleet.shared.store import Store

KILLS, CLIENTS, RATINGS, REDELIVERED = 8, 2, 400, 25
SECRET = "k" * 64


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.acked: set[str] = set()
        self.given_up: set[str] = set()
        self.cut = self.down = self.retries = self.refused = 0

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


def deliver(client: BridgeClient, body: dict, tally: Tally, deadline: float) -> bool:
    """Post one rating until it is acknowledged (2xx), retrying with the same event id; False if the
    bridge refused it for good or the time ran out."""
    wait = body.pop("wait", 0)
    while True:
        try:
            client.rate(wait=wait, **body)
            return True
        except BridgeError as exc:
            if exc.status < 500 and exc.status != 429:  # e.g. a retry in the same second: "replayed"
                tally.add(refused=1)
                return False
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                tally.add(down=1)  # nobody listening: the bridge is being restarted
            else:
                tally.add(cut=1)
        except (http.client.HTTPException, ConnectionError, TimeoutError):
            tally.add(cut=1)  # the connection died mid-request: the rating may or may not be queued
        if time.monotonic() > deadline:
            return False
        tally.add(retries=1)
        time.sleep(0.05)


def test_killed_bridge_loses_and_doubles_no_acknowledged_rating(chaos_home, tmp_path):
    rng = random.Random(20261126)
    cfg = load_config(model="tiny")
    cfg.train.threshold = 100_000
    cfg.bridge.port = free_port()
    cfg.bridge.rate_limit = 10_000
    cfg.save()
    cfg.secret_path.write_text(SECRET)
    cfg.secret_path.chmod(0o600)
    store = Store(cfg.db_url)
    for i in range(RATINGS):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")],
                                    response=f"a{i}", model="tiny"))
    env = env_for(cfg.home)
    log = tmp_path / "processes.log"
    url = f"http://127.0.0.1:{cfg.bridge.port}"

    def start_bridge():
        proc = spawn(["rlfleet.cli", "bridge"], env, log)  # `rlfleet bridge`
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return proc
            except OSError:
                pass
            assert proc.poll() is None, f"the bridge did not start\n{tail(log)}"
            assert time.monotonic() < deadline, f"the bridge did not answer\n{tail(log)}"
            time.sleep(0.05)

    events = worker("events", env, log)
    bridge = start_bridge()
    tally = Tally()
    sent: set[str] = set()
    deadline = time.monotonic() + 45

    def post(offset: int) -> None:
        client = BridgeClient(url, SECRET, timeout=5)
        for i in range(offset, RATINGS, CLIENTS):
            if stop_posting.is_set():
                return
            event_id = str(uuid.uuid4())
            with tally.lock:
                sent.add(event_id)
            body = {"target": f"c{i}", "value": "good" if i % 3 else "bad", "event_id": event_id,
                    "wait": 0.5 if i % 2 else 0}
            ok = deliver(client, body, tally, deadline)
            with tally.lock:
                (tally.acked if ok else tally.given_up).add(event_id)

    stop_posting = threading.Event()
    clients = [threading.Thread(target=post, args=(k,), daemon=True) for k in range(CLIENTS)]
    started = time.monotonic()
    for c in clients:
        c.start()
    kills = 0
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 1.0))  # while requests are in flight
            kill9(bridge)
            kills += 1
            bridge = start_bridge()
        stop_posting.set()  # the rest would only show the bridge works when nobody kills it
        for c in clients:
            c.join(30)
            assert not c.is_alive(), "a client is stuck"
        # duplicate deliveries: a gateway that never saw its 2xx sends again; so does a confused one
        again = rng.sample(sorted(tally.acked), min(REDELIVERED, len(tally.acked)))
        time.sleep(1.1)  # a new second: the same body gets a new signature (an identical one is a replay)
        client = BridgeClient(url, SECRET, timeout=5)
        for event_id in again:
            client.rate("c0", "good", event_id=event_id)  # same id, even another body: still a no-op
        deadline_apply = time.monotonic() + 30
        while True:
            found = stored_counts(cfg.db_url)
            if tally.acked <= set(found):
                time.sleep(1.0)  # and whatever repeats are still queued behind them
                if not _queued(cfg):
                    break
            assert time.monotonic() < deadline_apply, f"not applied in time\n{tail(log)}"
            assert events.poll() is None, f"the events worker died\n{tail(log)}"
            time.sleep(0.2)
    finally:
        stop_posting.set()
        stop(bridge)
        stop(events)
    elapsed = time.monotonic() - started

    found = stored_counts(cfg.db_url)
    absorbed = _repeats_absorbed(cfg)
    print(f"\nchaos/bridge: {kills} SIGKILLs of the bridge, {len(sent)} ratings sent, {len(tally.acked)} acknowledged "
          f"(2xx), {len(tally.given_up)} given up, {tally.cut} requests cut mid-way, {tally.down} refused while "
          f"down, {tally.refused} refused (4xx), {tally.retries} retries + {len(again)} deliberate re-deliveries, "
          f"{absorbed} repeats reached the worker and were ignored, {len(found)} found, "
          f"{sum(n - 1 for n in found.values())} doubled; {elapsed:.0f} s")
    assert kills == KILLS
    assert tally.cut + tally.down > 0, "no kill hit a request: the test lost its teeth"
    assert len(tally.acked) >= len(sent) * 3 // 4
    assert tally.acked <= set(found), f"lost {len(tally.acked - set(found))} acknowledged ratings"
    assert set(found) <= sent
    assert all(n == 1 for n in found.values())  # exactly once


def _queued(cfg) -> int:
    handle = open_queue(cfg)
    try:
        return handle.waiting_events()
    finally:
        handle.close()


def _repeats_absorbed(cfg) -> int:
    """Deliveries the worker recognised as repeats of an event it had applied (the store's idempotency)."""
    handle = open_queue(cfg)
    try:
        answers = [handle.redis.get(k) for k in handle.redis.scan_iter(result_key("*"))]
        return sum(bool(json.loads(a).get("duplicate")) for a in answers if a)
    finally:
        handle.close()
