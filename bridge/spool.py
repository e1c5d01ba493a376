"""The hooks' safety net: when the bridge cannot take a request, it goes to an append-only file.

Each line is one bridge request (method, path, JSON body with its own ``event_id``), written with
fsync under a file lock, so a crash loses nothing that was acknowledged. Draining renames the file
first (new requests start a fresh one), hands every line on, and deletes the renamed file only when
all went through; a crash mid-drain leaves it to be drained again, and the event ids make the repeat
a no-op in the store: every event lands exactly once. Standard library only (hooks must start fast).
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

SPOOL = "spool.jsonl"
DRAINING = "spool.draining.jsonl"


def spool_dir(home: Path) -> Path:
    return home / "spool"


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def with_event_id(body: dict) -> dict:
    """Every spooled request carries its idempotency key from the start."""
    return body if body.get("event_id") else {**body, "event_id": str(uuid.uuid4())}


def append(home: Path, method: str, path: str, body: dict) -> None:
    line = json.dumps({"method": method, "path": path, "body": with_event_id(body)}, separators=(",", ":"))
    folder = spool_dir(home)
    with _locked(folder):
        fd = os.open(folder / SPOOL, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)


def pending(home: Path) -> int:
    folder = spool_dir(home)
    n = 0
    for name in (DRAINING, SPOOL):
        try:  # read without the lock: a drain may rename or delete the file under us
            with open(folder / name, "rb") as fh:
                n += sum(1 for line in fh if line.strip())
        except FileNotFoundError:
            continue
    return n


def drain(home: Path, send: Callable[[str, str, dict], None]) -> tuple[int, int]:
    """Hand every spooled request to ``send`` in order; ``(sent, dropped)``. Stops at the first send that
    raises ``ConnectionError`` (the lines stay for next time); a line ``send`` rejects with ``ValueError``
    (malformed, refused as invalid) is dropped, as resending it could never succeed."""
    folder = spool_dir(home)
    if not (folder / SPOOL).exists() and not (folder / DRAINING).exists():
        return 0, 0
    sent = dropped = 0
    with _locked(folder):
        if not (folder / DRAINING).exists():
            if not (folder / SPOOL).exists():  # another drain emptied it while this one waited for the lock
                return 0, 0
            os.replace(folder / SPOOL, folder / DRAINING)
        lines = (folder / DRAINING).read_bytes().splitlines()
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                item = json.loads(raw)
                send(item["method"], item["path"], item["body"])
                sent += 1
            except ConnectionError:
                rest = b"\n".join(x for x in lines[i:] if x.strip()) + b"\n"
                tmp = folder / (DRAINING + ".tmp")
                tmp.write_bytes(rest)
                os.replace(tmp, folder / DRAINING)
                return sent, dropped
            except (ValueError, KeyError, TypeError):
                dropped += 1
        (folder / DRAINING).unlink()
    return sent, dropped
