"""Whether the Redis holding the inbox keeps what it acknowledged across a power cut.

A producer answers its user once the event is in Redis (a bot's "noted", the bridge's 202), and a
drain removes the event from Redis once its row is committed. So an acknowledged event is on disk
only if Redis writes every change to its append-only file and fsyncs it before replying:
``appendonly yes`` and ``appendfsync always``. The embedded server runs that way; an external
``REDIS_URL`` is checked here, and ``rlfleet status`` warns when it cannot keep the promise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import redis

NEEDS = "appendonly yes and appendfsync always"


@dataclass(frozen=True)
class Durability:
    """``ok`` None: the server would not say (managed services often refuse CONFIG)."""

    ok: bool | None
    appendonly: str | None
    appendfsync: str | None
    warning: str | None

    def as_dict(self) -> dict:
        return asdict(self)


def _setting(conn: redis.Redis, name: str) -> str | None:
    got = conn.config_get(name)
    for key, value in got.items():
        key = key.decode() if isinstance(key, bytes) else key
        if key == name:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def check(conn: redis.Redis) -> Durability:
    """Read the server's persistence settings and say what an acknowledgement is worth."""
    try:
        appendonly, appendfsync = _setting(conn, "appendonly"), _setting(conn, "appendfsync")
    except redis.ResponseError as exc:  # CONFIG renamed away, or an ACL without it
        why = str(exc).splitlines()[0][:120] if str(exc) else "refused"
        return Durability(None, None, None, f"could not check Redis persistence (CONFIG GET: {why}); "
                                            f"acknowledged events survive a power cut only with {NEEDS}")
    if appendonly != "yes":
        warning = (f"Redis keeps no append-only file (appendonly {appendonly}): acknowledged events not "
                   f"yet stored are lost if it stops; it needs {NEEDS}")
    elif appendfsync != "always":
        when = "every second" if appendfsync == "everysec" else "when the OS does"
        warning = (f"Redis fsyncs its append-only file {when} (appendfsync {appendfsync}): a power cut can "
                   f"lose acknowledged events not yet stored; it needs {NEEDS}")
    else:
        warning = None
    return Durability(warning is None, appendonly, appendfsync, warning)
