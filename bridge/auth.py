"""Request signing for the bridge: HMAC-SHA256 over ``timestamp \\n METHOD \\n path \\n`` + the raw body.

Pure functions, shared by the server (`bridge/app.py`) and the client (`bridge/client.py`), so the two
can never disagree about what is signed.
"""

from __future__ import annotations

import hashlib
import hmac
import time

TIMESTAMP_HEADER = "X-Rlfleet-Timestamp"
SIGNATURE_HEADER = "X-Rlfleet-Signature"
KEY_HEADER = "X-Rlfleet-Key"  # which key signed (default "local": the data dir's secret file)
MAX_SKEW_S = 300


def signature(secret: str, timestamp: str, method: str, path: str, body: bytes) -> str:
    message = f"{timestamp}\n{method.upper()}\n{path}\n".encode() + body
    return "sha256=" + hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, path: str, body: bytes, key: str = "local", now: float | None = None) -> dict:
    """The headers that authenticate one request."""
    ts = str(int(time.time() if now is None else now))
    return {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: signature(secret, ts, method, path, body), KEY_HEADER: key}


def verify(secret: str, headers: dict, method: str, path: str, body: bytes, now: float | None = None) -> str | None:
    """None when the request is authentic and fresh; else the reason (said to the caller as is)."""
    ts, sig = headers.get(TIMESTAMP_HEADER, ""), headers.get(SIGNATURE_HEADER, "")
    if not ts or not sig:
        return f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER}"
    if not (ts.isascii() and ts.isdigit()) or len(ts) > 12:  # (a float takes a few hundred digits at most)
        return f"{TIMESTAMP_HEADER} is not unix seconds"
    if abs((time.time() if now is None else now) - int(ts)) > MAX_SKEW_S:
        return f"stale request: {TIMESTAMP_HEADER} is more than {MAX_SKEW_S} s from now"
    if not hmac.compare_digest(signature(secret, ts, method, path, body), sig):
        return "bad signature"
    return None
