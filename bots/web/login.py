"""Who may use the web app: whoever holds the login token (a 0600 file in the data dir, printed when
``rlfleet web`` starts). The page logs in once and gets a signed session cookie that expires; an API
client sends the token itself as ``Authorization: Bearer``. Pure functions over the token and a clock."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from rlfleet.shared.secrets_file import read_secret_file

COOKIE = "rlfleet_web"


def ensure_token(path: Path) -> tuple[str, bool]:
    """The login token in ``path``, made (0600, never logged) when there is none; True when made now."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: read theirs
            return read_secret_file(path, "the web login token"), False
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24) + "\n")
        return read_secret_file(path, "the web login token"), True
    return read_secret_file(path, "the web login token"), False


def _sign(token: str, expires: int) -> str:
    return hmac.new(token.encode(), f"session:{expires}".encode(), hashlib.sha256).hexdigest()


def session_cookie(token: str, now: float, hours: float) -> str:
    """A cookie value that proves a login until ``now + hours``: the expiry and its HMAC under the token,
    so changing the token file logs every browser out."""
    expires = int(now + hours * 3600)
    return f"{expires}.{_sign(token, expires)}"


def valid_session(token: str, cookie: str | None, now: float) -> bool:
    """True for a cookie made by :func:`session_cookie` with this token that has not expired."""
    if not cookie or "." not in cookie:
        return False
    expires, _, sig = cookie.partition(".")
    if not (expires.isascii() and expires.isdigit()) or len(expires) > 12:  # not "²" or "٣": int() refuses those
        return False
    return int(expires) > now and hmac.compare_digest(sig, _sign(token, int(expires)))


def valid_bearer(token: str, header: str | None) -> bool:
    """True for ``Authorization: Bearer <the token>`` (the scheme in any case, as RFC 9110 has it)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
