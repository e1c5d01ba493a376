"""The events inbox: how ratings reach the worker in batches instead of one RQ job each.

A producer (bot, bridge, CLI) appends the event's JSON to one Redis list and, when no drain owns the
inbox, queues one RQ drain job (``job_names.DRAIN_JOB``). The drain moves up to a batch of
events into a "taken" list, applies them in one database transaction, writes each event's answer
under its own key, and empties "taken"; it keeps going until the inbox is empty and then lets go.

Why: an RQ job costs about as much Redis work and Python as a hundred ratings applied in a batch, so
one job per rating capped intake at RQ's own job rate. And one drain at a time applies one user's
rapid events in the order they were sent.

Replays: redis-py sends a command again when the connection dropped before its reply came, so a
command that did run can run twice. Every write here is safe to repeat: a batch in TAKEN carries a
token and only the answer of that batch empties TAKEN (a repeated answer-and-take must not drop the
batch its first run took), and claiming or handing over the inbox succeeds again for the same drain.

A batch's commit need not wait for the disk: its events then move from TAKEN to "unsynced", where
they stay until the drain's database sync (shared/dbsync.py) has put that commit on disk, so a
database that lost its last commits in a power cut gets them back from Redis: a new drain applies
the unsynced batches again, first.

Crash safety: an event is in Redis (append-only) before the producer answers; "taken" holds what a
drain was applying, so a drain killed mid-batch leaves its events where the next one (RQ requeues the
killed job) applies them again, and the store's event-id idempotency makes the repeat harmless. An
event that fails for a reason of its own (not the database's) is tried ``MAX_ATTEMPTS`` times and then
dead-lettered with the error, answered as failed; it never blocks the events behind it.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import redis

from .redis_text import as_text

INBOX = "rlfleet:inbox"  # event JSON, oldest first
TAKEN = "rlfleet:inbox:taken"  # the batch the owning drain is applying
OWNER = "rlfleet:inbox:drain"  # id of the drain job that owns the inbox
BATCH_ID = "rlfleet:inbox:taken:id"  # token of the batch in TAKEN: only its own answer empties TAKEN
UNSYNCED = "rlfleet:inbox:unsynced"  # tokens of answered batches whose commits may not be on disk yet
UNSYNCED_BATCH = "rlfleet:inbox:unsynced:"  # + token: that batch's events, until a sync confirms it
ATTEMPTS = "rlfleet:inbox:attempts"  # event id -> failed attempts so far
DEAD = "rlfleet:inbox:dead"  # {"event": ..., "error": ..., "ts": ...} of events given up on
BELL = "rlfleet:inbox:bell"  # pub/sub channel every push rings: a drain waiting for more wakes at once
OWNER_TTL = 60  # a drain renews it every batch; a lost one frees the inbox after this many seconds
RESULT_TTL = 3600
STAMPS = ("taken_at", "answered_at")  # when the drain took an event and answered it; for benchmarks
BATCH = 256
MAX_ATTEMPTS = 5


def new_drain_id() -> str:
    return f"rlfleet-drain-{uuid.uuid4().hex}"


def result_key(event_id: str) -> str:
    return f"rlfleet:result:{event_id}"


def command_key(event_id: str) -> str:
    """Set when a drain runs a command: a repeated batch must not run it twice."""
    return f"rlfleet:command:{event_id}"


# Owning and taking are one step: a drain that lost the inbox (its claim expired and another took it)
# takes nothing. What a dead drain left in TAKEN is applied again before anything new. The reply is the
# batch's token, then its events.
_TAKE = """
local owner = redis.call('GET', KEYS[3])
if owner ~= ARGV[1] then
  if owner then return false end
  redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[3])
else
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
if ARGV[5] == '1' then
  -- a new drain: batches a dead one answered but never saw on disk go first, then what it had taken
  local tokens = redis.call('LRANGE', KEYS[5], 0, -1)
  if #tokens > 0 then
    local older = {}
    for _, t in ipairs(tokens) do
      for _, item in ipairs(redis.call('LRANGE', ARGV[6] .. t, 0, -1)) do table.insert(older, item) end
      redis.call('DEL', ARGV[6] .. t)
    end
    for _, item in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do table.insert(older, item) end
    redis.call('DEL', KEYS[2], KEYS[5])
    if #older > 0 then
      for i = 1, #older, 1000 do redis.call('RPUSH', KEYS[2], unpack(older, i, math.min(i + 999, #older))) end
      if not redis.call('GET', KEYS[4]) then redis.call('SET', KEYS[4], ARGV[4]) end
    end
  end
end
local taken = redis.call('LRANGE', KEYS[2], 0, -1)
if #taken > 0 then
  local token = redis.call('GET', KEYS[4])
  if not token then
    token = ARGV[4]
    redis.call('SET', KEYS[4], token)
  end
  table.insert(taken, 1, token)
  return taken
end
local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[2]) - 1)
if #items > 0 then
  redis.call('LTRIM', KEYS[1], #items, -1)
  redis.call('RPUSH', KEYS[2], unpack(items))
  redis.call('SET', KEYS[4], ARGV[4])
end
table.insert(items, 1, ARGV[4])
return items
"""

# A batch is finished only by its own answer: run again after the next take, it leaves that batch be.
# Finished and on disk, its events go; finished with its commit not yet on disk, they wait as unsynced.
_FINISH = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
if ARGV[2] == '1' or redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('RENAME', KEYS[1], ARGV[3] .. ARGV[1])
  redis.call('RPUSH', KEYS[3], ARGV[1])
  redis.call('DEL', KEYS[2])
end
return 0
"""

# Batches whose commits a sync put on disk: their events can go.
_CONFIRM = """
for i = 2, #ARGV do
  redis.call('DEL', ARGV[1] .. ARGV[i])
  redis.call('LREM', KEYS[1], 0, ARGV[i])
end
return 0
"""

# Claiming a key (SET NX EX) so that a resent claim is still the claimer's: true again for the same holder.
_CLAIM = """
local owner = redis.call('GET', KEYS[1])
if not owner then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
return owner == ARGV[1] and 1 or 0
"""

# Letting go and looking for late arrivals are one step: a producer appends before it tries to claim
# the inbox, so an event appended after this either finds the inbox free (and queues a drain) or was
# seen here (and this drain goes on).
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if redis.call('LLEN', KEYS[2]) > 0 or redis.call('LLEN', KEYS[3]) > 0 then return 1 end
redis.call('DEL', KEYS[1])
return 0
"""


@dataclass(frozen=True)
class Batch:
    """What a drain took: the events to apply, and the token its answer must name."""

    token: str
    items: list[bytes]
    taken_at: float = 0.0  # epoch seconds: when the drain got it (for measuring where latency goes)


def _batch(got: list | None) -> Batch | None:
    if got is None:
        return None
    token, *items = got
    return Batch(token.decode() if isinstance(token, bytes) else str(token), items, time.time())


@dataclass(frozen=True)
class Ticket:
    """What a producer holds after handing an event over: its answer, once a drain has applied it."""

    event_id: str
    conn: redis.Redis

    def result(self) -> dict | None:
        raw = self.conn.get(result_key(self.event_id))
        if raw is None:
            return None
        result = json.loads(raw)
        for stamp in STAMPS:
            result.pop(stamp, None)
        return result


def claim(conn: redis.Redis, key: str, holder: str, ttl: int) -> bool:
    """``SET key holder NX EX ttl`` that stays true when redis-py resends it: whether ``holder`` has it."""
    return bool(conn.eval(_CLAIM, 1, key, holder, ttl))


def push(conn: redis.Redis, event_id: str, payload: str) -> tuple[Ticket, str | None]:
    """Append an event; returns its ticket and, when this call claimed the inbox, the drain job id
    the caller must queue (None: a drain already owns it and will see the event)."""
    drain_id = new_drain_id()
    pipe = conn.pipeline(transaction=False)
    pipe.rpush(INBOX, payload)
    pipe.publish(BELL, b"")  # after the event: a drain woken by it finds the event there
    pipe.eval(_CLAIM, 1, OWNER, drain_id, OWNER_TTL)
    _, _, claimed = pipe.execute()
    return Ticket(event_id, conn), drain_id if claimed else None


def take(conn: redis.Redis, drain_id: str, batch: int | None = None, *, first: bool = False) -> Batch | None:
    """The next batch for drain ``drain_id`` (no items: nothing left); None if another drain owns the inbox.
    A drain's ``first`` take starts with the unsynced batches a dead drain left."""
    return _batch(conn.eval(*_take_args(drain_id, batch or BATCH, first)))


def _take_args(drain_id: str, batch: int, first: bool) -> tuple:
    return (_TAKE, 5, INBOX, TAKEN, OWNER, BATCH_ID, UNSYNCED, drain_id, batch, OWNER_TTL, uuid.uuid4().hex,
            "1" if first else "0", UNSYNCED_BATCH)


def answer_and_take(conn: redis.Redis, results: dict[str, dict], batch: Batch, drain_id: str,
                    *, synced: bool = True) -> Batch | None:
    """``answer`` ``batch``, then ``take`` the next one for drain ``drain_id``, in one round trip and one
    transaction: with ``appendfsync always`` one fsync per batch instead of two."""
    pipe = _answering(conn, results, batch, synced)
    pipe.eval(*_take_args(drain_id, BATCH, False))
    return _batch(pipe.execute()[-1])


def unsynced(conn: redis.Redis) -> list[str]:
    """Tokens of the answered batches still waiting for a database sync, oldest first."""
    return [as_text(t) for t in conn.lrange(UNSYNCED, 0, -1)]


def confirm(conn: redis.Redis, tokens: list[str]) -> None:
    """Batches ``tokens`` are on disk in the database: let their events go."""
    if tokens:
        conn.eval(_CONFIRM, 1, UNSYNCED, UNSYNCED_BATCH, *tokens)


class Doorbell:
    """What a drain waits on when the inbox is empty, instead of polling it. Pub/sub, not a list: a
    ring writes nothing, so it costs the server no append-only write and no fsync. A ring that comes
    while the drain is busy is still waiting in the subscription, so a push is never slept through."""

    def __init__(self, conn: redis.Redis) -> None:
        self.sub = conn.pubsub()
        self.sub.subscribe(BELL)
        # subscribed before the first take: a push after that take is then sure to ring here
        while (m := self.sub.get_message(timeout=1.0)) is not None and m["type"] != "subscribe":
            pass

    def wait(self, timeout: float) -> None:
        """Until a push rings (or ``timeout`` seconds pass); the rings already waiting are all consumed
        (their events are in the inbox for the next take)."""
        if self.sub.get_message(timeout=timeout) is not None:
            while self.sub.get_message(timeout=0) is not None:
                pass

    def close(self) -> None:
        self.sub.close()


def release(conn: redis.Redis, drain_id: str) -> bool:
    """Let go of the inbox; False when events arrived meanwhile (the drain keeps it and goes on)."""
    return not conn.eval(_RELEASE, 3, OWNER, INBOX, TAKEN, drain_id)


def hand_over(conn: redis.Redis, drain_id: str) -> str | None:
    """Pass the inbox from drain ``drain_id`` to a new drain; its id, which the caller queues (None:
    ``drain_id`` did not own it any more)."""
    successor = new_drain_id()
    moved = conn.eval("local owner = redis.call('GET', KEYS[1]) "
                      "if owner == ARGV[2] then return 1 end "  # this very hand-over, repeated
                      "if owner ~= ARGV[1] then return 0 end "
                      "redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return 1",
                      1, OWNER, drain_id, successor, OWNER_TTL)
    return successor if moved else None


def answer(conn: redis.Redis, results: dict[str, dict], batch: Batch, *, synced: bool = True) -> None:
    """Store each event's answer (stamped with the times it was taken and became visible: after its
    commit) and empty TAKEN if it still holds ``batch``: the batch is finished (not ``synced``: its
    commit may not be on disk yet, and its events wait as unsynced until ``confirm``)."""
    _answering(conn, results, batch, synced).execute()


def _answering(conn: redis.Redis, results: dict[str, dict], batch: Batch, synced: bool) -> redis.client.Pipeline:
    stamps = {"taken_at": batch.taken_at, "answered_at": time.time()}
    pipe = conn.pipeline(transaction=True)
    for event_id, result in results.items():
        pipe.set(result_key(event_id), json.dumps({**result, **stamps}, default=str), ex=RESULT_TTL)
    if results:
        pipe.hdel(ATTEMPTS, *results)
    pipe.eval(_FINISH, 3, TAKEN, BATCH_ID, UNSYNCED, batch.token, "1" if synced else "0", UNSYNCED_BATCH)
    return pipe


def failed_attempt(conn: redis.Redis, event_id: str) -> int:
    n = int(conn.hincrby(ATTEMPTS, event_id, 1))
    conn.expire(ATTEMPTS, 7 * 24 * 3600)
    return n


def retry_later(conn: redis.Redis, payload: bytes) -> None:
    """Put an event that failed back at the end of the inbox, behind the ones that did not."""
    conn.rpush(INBOX, payload)


def dead_letter(conn: redis.Redis, payload: bytes | str, error: str) -> None:
    text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
    conn.rpush(DEAD, json.dumps({"event": text, "error": error, "ts": time.time()}))


def stamps(conn: redis.Redis, event_ids: list[str]) -> dict[str, dict[str, float]]:
    """When a drain took each answered event and when its answer became visible (epoch seconds, by
    ``STAMPS``); for measuring latency."""
    pipe = conn.pipeline(transaction=False)
    for event_id in event_ids:
        pipe.get(result_key(event_id))
    out = {}
    for event_id, raw in zip(event_ids, pipe.execute(), strict=True):
        if raw:
            result = json.loads(raw)
            out[event_id] = {k: result[k] for k in STAMPS}
    return out


_REQUEUE_DEAD = """
local n = 0
while true do
  local item = redis.call('LPOP', KEYS[1])
  if not item then break end
  local ok, rec = pcall(cjson.decode, item)
  if ok and type(rec) == 'table' and rec['event'] then
    redis.call('RPUSH', KEYS[2], rec['event'])
    n = n + 1
  end
end
redis.call('DEL', KEYS[3])
return n
"""


def requeue_dead(conn: redis.Redis) -> int:
    """Put every set-aside event back in the inbox with fresh attempts (after the cause was fixed);
    the caller makes sure a drain runs. Returns how many."""
    return int(conn.eval(_REQUEUE_DEAD, 3, DEAD, INBOX, ATTEMPTS))


def pending(conn: redis.Redis) -> int:
    """Events handed over and not yet applied."""
    pipe = conn.pipeline(transaction=False)
    pipe.llen(INBOX)
    pipe.llen(TAKEN)
    return sum(pipe.execute())


def dead(conn: redis.Redis) -> list[dict]:
    return [json.loads(x) for x in conn.lrange(DEAD, 0, -1)]


def wait(ticket: Ticket, timeout: float) -> dict | None:
    """The event's answer once a drain applied it; None if it is still waiting at ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        result = ticket.result()
        if result is not None or time.monotonic() >= deadline:
            return result
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 0.1)
