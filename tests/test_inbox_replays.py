"""The inbox's writes survive redis-py's retries: when a connection drops after a command ran but before
its reply came back, the client sends the command again on a new connection. A loopback proxy between
the client and the real Redis cuts the connection at exactly that moment; the command then runs twice,
and nothing may be lost or stranded by the repeat."""

from __future__ import annotations

import socket
import threading

import pytest
import redis

from rlfleet.shared import inbox
from rlfleet.shared.events import Rating


class ReplyCutter:
    """A TCP proxy to Redis that, once armed, forwards the next request holding ``marker``, lets the
    server run it and read its reply, then drops both sides without passing the reply on."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.marker: bytes | None = None
        self.cuts = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, marker: bytes) -> None:
        self.marker = marker

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.socks += [client, server]
            cutting = threading.Event()  # this connection's next reply is to be swallowed
            threading.Thread(target=self._requests, args=(client, server, cutting), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, cutting), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket, cutting: threading.Event) -> None:
        while data := _recv(client):
            if self.marker is not None and self.marker in data:
                self.marker = None
                cutting.set()
            try:
                server.sendall(data)
            except OSError:
                break
        _close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, cutting: threading.Event) -> None:
        while data := _recv(server):
            if cutting.is_set():  # the server ran it and answered: the client never hears of it
                self.cuts += 1
                break
            try:
                client.sendall(data)
            except OSError:
                break
        _close(server, client)

    def close(self) -> None:
        self.listener.close()
        _close(*self.socks)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _close(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


@pytest.fixture
def cut_conn(rconn):
    """(a direct connection, a connection through the cutter, the cutter) on the tests' Redis."""
    direct = rconn
    kw = direct.connection_pool.connection_kwargs
    if "host" not in kw:
        pytest.fail("this test needs Redis over TCP (the tests' Redis on 127.0.0.1)")
    cutter = ReplyCutter(kw["host"], kw["port"])
    via = redis.Redis(host="127.0.0.1", port=cutter.port, db=kw.get("db", 0))  # redis-py's default retries
    yield direct, via, cutter
    via.close()
    cutter.close()


def _events(n: int, start: int) -> list[str]:
    return [Rating(target=f"c{i}", value=1).model_dump_json() for i in range(start, start + n)]


def test_a_repeated_answer_and_take_keeps_the_batch_its_first_run_took(cut_conn):
    direct, via, cutter = cut_conn
    me = inbox.new_drain_id()
    direct.rpush(inbox.INBOX, *_events(3, 0))
    first = inbox.take(direct, me)
    assert first is not None and len(first.items) == 3
    second_events = _events(2, 3)
    direct.rpush(inbox.INBOX, *second_events)  # arrived while the first batch was applied
    cutter.arm(b"EXEC")
    got = inbox.answer_and_take(via, {"e": {"ok": True}}, first, me)
    assert cutter.cuts == 1  # it did run twice
    assert got is not None and [x.decode() for x in got.items] == second_events
    assert [x.decode() for x in direct.lrange(inbox.TAKEN, 0, -1)] == second_events  # still there to apply
    inbox.answer(direct, {}, got)
    assert direct.llen(inbox.TAKEN) == 0 and direct.llen(inbox.INBOX) == 0


def test_a_repeated_push_still_tells_its_producer_to_queue_the_drain(cut_conn):
    direct, via, cutter = cut_conn
    cutter.arm(inbox.OWNER.encode())  # the claim travels with the event in one pipeline
    _, drain_id = inbox.push(via, "e1", _events(1, 0)[0])
    assert cutter.cuts == 1
    assert drain_id is not None and direct.get(inbox.OWNER).decode() == drain_id  # no drain-less owner
    assert direct.llen(inbox.INBOX) >= 1  # delivered (twice: the store ignores the repeat)


def test_a_repeated_hand_over_still_names_the_successor(cut_conn):
    direct, via, cutter = cut_conn
    me = inbox.new_drain_id()
    direct.rpush(inbox.INBOX, *_events(1, 0))
    assert inbox.take(direct, me) is not None
    cutter.arm(inbox.OWNER.encode())
    successor = inbox.hand_over(via, me)
    assert cutter.cuts == 1
    assert successor is not None and direct.get(inbox.OWNER).decode() == successor


def test_a_resent_claim_is_still_the_claimers_and_nobody_elses(cut_conn):
    direct, via, cutter = cut_conn  # what a command's at-most-once key and ensure_drain's claim rely on
    cutter.arm(b"rlfleet:command:e1")
    assert inbox.claim(via, inbox.command_key("e1"), "drain-a", 60)
    assert cutter.cuts == 1
    assert not inbox.claim(direct, inbox.command_key("e1"), "drain-b", 60)  # a repeated batch: already run


def test_a_resent_training_claim_still_queues_the_run(cut_conn, home):
    from rq import Queue

    from rlfleet.shared.config import load_config
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import TRAIN_QUEUE, TRAINING_BUSY, train_lock_key
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.store import Store
    from rlfleet.worker.context import Context
    from rlfleet.worker.trigger import maybe_trigger

    direct, via, cutter = cut_conn
    cfg = load_config(home)
    slug = model_slug(cfg.model)
    ctx = Context(cfg, Store(cfg.db_url), slug, AdapterRegistry(cfg.adapters_root, slug), 0.0)
    caps = [inbox_capture(i) for i in range(2)]
    ctx.store.apply_many(caps, slug)
    ctx.store.apply_many([Rating(target=c.capture_id, value=1) for c in caps], slug)
    lock = train_lock_key(slug)
    cutter.arm(lock.encode())
    said = maybe_trigger(ctx, via, force=True)
    assert cutter.cuts == 1  # the claim ran twice
    assert said is not None and said != TRAINING_BUSY and "queued" in said, said
    assert Queue(TRAIN_QUEUE, connection=direct).count == 1
    assert direct.get(lock).decode().startswith("rlfleet-train-")  # the queued job holds it, not a claim


def inbox_capture(i: int):
    from rlfleet.shared.events import Capture, Message

    return Capture(capture_id=f"t{i}", prompt=[Message(role="user", content="q")], response="a", model="m")
