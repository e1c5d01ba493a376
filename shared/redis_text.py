"""Redis replies as text.

Our clients keep redis-py's default of undecoded replies (RQ stores pickles and needs bytes), while
redis-py types a reply as ``bytes | str``, since a client may be made to decode; ``as_text`` takes either.
"""

from __future__ import annotations


def as_text(reply: bytes | str) -> str:
    return reply.decode() if isinstance(reply, bytes) else reply
