"""Which platform messages are answers a bot posted and captured, and whose they are.

A reaction or a button press names a platform message; only the answers we captured can be rated,
and only by their owner or an allowlisted rater. The map lives in Redis (written the moment the bot
posts, before the capture event is even applied) with the store as the durable fallback, so a bot
restart, or a Redis that keeps nothing on disk, forgets nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from .events import well_formed
from .store import Store


@dataclass(frozen=True)
class Posted:
    capture_id: str
    owner: str


def _key(source: str) -> str:
    return f"rlfleet:posted:{source}"


def _field(conversation: str, message_ref: str) -> str:
    return well_formed(f"{conversation}\n{message_ref}")  # a lone surrogate is no Redis key


class PostedMessages:
    def __init__(self, conn: redis.Redis, store: Store | None = None) -> None:
        self.conn = conn
        self.store = store

    def remember(self, source: str, conversation: str, message_ref: str, capture_id: str, owner: str) -> None:
        value = json.dumps({"capture_id": capture_id, "owner": owner})
        self.conn.hset(_key(source), _field(conversation, message_ref), value)

    def lookup(self, source: str, conversation: str, message_ref: str) -> Posted | None:
        raw = self.conn.hget(_key(source), _field(conversation, message_ref))
        if raw is not None:
            data = json.loads(raw)
            return Posted(data["capture_id"], data["owner"])
        if self.store is None:
            return None
        found = self.store.find_capture(source, conversation, message_ref)
        if found is None:
            return None
        self.remember(source, conversation, message_ref, *found)
        return Posted(*found)

    # Threads the bot answered in: a reply there is addressed to it without a mention.
    def remember_thread(self, source: str, conversation: str, thread: str) -> None:
        self.conn.sadd(f"rlfleet:threads:{source}", _field(conversation, thread))

    def in_thread(self, source: str, conversation: str, thread: str) -> bool:
        return bool(self.conn.sismember(f"rlfleet:threads:{source}", _field(conversation, thread)))
