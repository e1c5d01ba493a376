"""The coding-agent hooks: ``python -m rlfleet.bridge.hook claude-code|codex prompt|stop``.

- ``prompt`` (UserPromptSubmit): a prompt that starts with ``/rl`` is handled here and blocked from
  reaching the model (``{"decision": "block", "reason": ...}``: the reason is shown to the user, not
  to the model, in both Claude Code and Codex); any other prompt is remembered for the Stop hook.
- ``stop`` (Stop): the remembered prompt and the hook's ``last_assistant_message`` become a capture,
  with the agent's session as the conversation. It prints nothing and exits 0: a Stop hook that exits
  2 or prints a block decision would make the agent keep going.

Hooks must never get in the agent's way: standard library only (no pydantic, no Redis client) so a
hook returns in tens of milliseconds, every error goes to ``<data dir>/logs/hooks.log``, and the exit
code is 0. Requests go to the bridge over loopback with a short timeout; when it is not running they
are spooled (`bridge/spool.py`) and drained by the next hook or by the bridge when it starts.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from . import spool
from .auth import sign

AGENTS = ("claude-code", "codex")
# A bridge that is not running refuses the connection at once, whatever this is; the wait only
# applies to a running bridge that is slow (beside a training run that fills every core). Past it the
# request is spooled, and the user told the bridge is busy (its spool poll takes it seconds later).
TIMEOUT_S = 1.0
MAX_STDIN = 4 << 20


# ---- settings without pydantic: the data dir, the bridge address, the secret --------------------------


def home() -> Path:
    return Path(os.environ.get("RLFLEET_HOME") or Path.home() / ".rlfleet").expanduser()


def settings(h: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        cfg = tomllib.loads((h / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = {}
    bridge = cfg.get("bridge", {})
    return {"host": bridge.get("host", "127.0.0.1"), "port": int(bridge.get("port", 8765)),
            "agent_admin": bool(bridge.get("agent_admin", False))}


def _log(h: Path, message: str) -> None:
    try:
        (h / "logs").mkdir(parents=True, exist_ok=True)
        with open(h / "logs" / "hooks.log", "a", encoding="utf-8") as fh:
            fh.write(time.strftime("%Y-%m-%dT%H:%M:%S ") + message.rstrip() + "\n")
    except OSError:
        pass


# ---- HTTP to the bridge over a plain socket (http.client would pull in ssl: slow to import) -----------


class BridgeSlow(ConnectionError):
    """The bridge took the connection but did not answer within ``TIMEOUT_S``: it is running, busy."""


class Bridge:
    def __init__(self, h: Path, conf: dict) -> None:
        self.home, self.conf = h, conf
        host = conf["host"]
        self.host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.port = conf["port"]
        try:
            self.secret = (h / "secret").read_text(encoding="utf-8").strip()
        except OSError:
            self.secret = ""

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """``(status, json)``; ``ConnectionError`` when the bridge is not there (or not set up)."""
        if not self.secret:
            raise ConnectionError("no secret file: run `rlfleet init`")
        raw = json.dumps(body).encode() if body is not None else b""
        headers = {"Host": f"{self.host}:{self.port}", "Content-Type": "application/json",
                   "Content-Length": str(len(raw)), "Connection": "close",
                   **sign(self.secret, method, path, raw)}
        head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        try:
            with socket.create_connection((self.host, self.port), timeout=TIMEOUT_S) as sock:
                sock.sendall(head.encode() + raw)
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
        except TimeoutError as exc:
            raise BridgeSlow(str(exc) or "timed out") from None
        except OSError as exc:
            raise ConnectionError(str(exc)) from None
        response = b"".join(chunks)
        header, _, payload = response.partition(b"\r\n\r\n")
        try:
            status = int(header.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise ConnectionError("not an HTTP answer") from None
        try:
            data = json.loads(payload or b"{}")
        except ValueError:
            data = {}
        return status, data if isinstance(data, dict) else {}

    def send(self, method: str, path: str, body: dict) -> tuple[int, dict]:
        """Deliver (spooled requests first, in order) or spool: nothing acknowledged is ever lost. A spooled
        answer says why: ``down`` (nothing listens), ``slow`` (no answer in time) or ``busy`` (the
        bridge answered 5xx or 429, e.g. its Redis is down), with the status it answered."""
        body = spool.with_event_id(body)
        if spool.pending(self.home):
            try:
                spool.drain(self.home, self._resend)
            except ConnectionError:
                pass
        try:
            status, data = self.call(method, path, body)
        except ConnectionError as exc:
            spool.append(self.home, method, path, body)
            return 0, {"spooled": True, "why": "slow" if isinstance(exc, BridgeSlow) else "down"}
        if status >= 500 or status == 429:
            spool.append(self.home, method, path, body)
            return 0, {"spooled": True, "why": "busy", "status": status}
        return status, data

    def _resend(self, method: str, path: str, body: dict) -> None:
        status, data = self.call(method, path, body)
        if status == 422:
            raise ValueError(data.get("error", "invalid"))  # could never succeed: dropped
        if status >= 300:
            raise ConnectionError(f"bridge answered {status}")


# ---- the two hooks --------------------------------------------------------------------------------------


def _state_file(h: Path, agent: str, session: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in session)[:128] or "default"
    return h / "hooks" / f"{agent}-{safe}.json"


def on_prompt(agent: str, payload: dict, h: Path, bridge: Bridge) -> dict | None:
    """UserPromptSubmit: handle `/rl`, else remember the prompt. Returns the JSON to print, if any."""
    from rlfleet.shared.ingress.grammar import HELP, is_rl, parse_rl
    from rlfleet.shared.ingress.replies import WHY_USAGE, status_line

    prompt = str(payload.get("prompt") or "")
    session = str(payload.get("session_id") or "default")
    if not is_rl(prompt):
        path = _state_file(h, agent, session)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"prompt": prompt, "turn": payload.get("prompt_id") or payload.get("turn_id"),
                                   "at": time.time()}), encoding="utf-8")
        os.replace(tmp, path)
        return None
    cmd = parse_rl(prompt)
    base = {"source": agent, "actor": "local"}
    if cmd.verb in ("good", "bad"):
        status, data = bridge.send("POST", "/v1/ratings", {**base, "target": "last", "conversation": session,
                                                           "value": cmd.verb, "comment": cmd.arg,
                                                           **({"stars": cmd.stars} if cmd.stars else {})})
        reason = _said(status, data, f"rated the last answer {cmd.verb}")
    elif cmd.verb == "why":
        if not (cmd.arg or "").strip():
            reason = WHY_USAGE
        else:
            status, data = bridge.send("POST", "/v1/ratings", {**base, "target": "last", "conversation": session,
                                                               "value": None, "comment": cmd.arg})
            reason = _said(status, data, "noted why, on your last rating")
    elif cmd.verb == "undo":
        status, data = bridge.send("POST", "/v1/undo", base)
        reason = _said(status, data, "took back your last rating")
    elif cmd.verb == "status":
        try:
            status, data = bridge.call("GET", "/v1/status")
            reason = status_line(data) if status == 200 else data.get("error", f"bridge answered {status}")
        except BridgeSlow:
            reason = f"rlfleet's bridge is busy: it did not answer within {TIMEOUT_S:g} s, try again"
        except ConnectionError:
            reason = "rlfleet is not running: start it with `rlfleet up`"
    elif cmd.admin:
        if not bridge.conf["agent_admin"]:
            reason = f"/rl {cmd.verb} is off in agents: set bridge.agent_admin = true, or run `rlfleet {cmd.verb}`"
        else:
            args = {"version": cmd.arg} if cmd.verb == "rollback" and cmd.arg else {}
            status, data = bridge.send("POST", "/v1/commands", {"source": agent, "name": cmd.verb, "args": args})
            reason = _said(status, data, f"/rl {cmd.verb} sent")
    else:
        reason = (f"unknown command {cmd.unknown!r}. " if cmd.unknown else "") + HELP
    return {"decision": "block", "reason": f"rlfleet: {reason}"}


def _said(status: int, data: dict, done: str) -> str:
    why = data.get("why") if data.get("spooled") else None
    if why == "slow":
        return (f"{done}; rlfleet's bridge is busy (no answer within {TIMEOUT_S:g} s), so it is saved here and "
                "the bridge takes it within seconds (counted once)")
    if why == "busy":
        return (f"{done}; rlfleet's bridge could not queue it (it answered {data.get('status')}), so it is saved "
                "here and sent again once it can (counted once)")
    if why:
        return f"{done}; rlfleet is not running, so it is saved and applied when `rlfleet up` starts"
    if status == 202:
        return done
    return f"not recorded: {data.get('error', f'bridge answered {status}')}"


def last_user_prompt(transcript: Path) -> str | None:
    """The last real user prompt in a Claude Code transcript (JSONL; tool results are not prompts)."""
    last = None
    try:
        with transcript.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    item = json.loads(line)
                except ValueError:
                    continue
                if item.get("type") != "user" or item.get("isSidechain"):
                    continue
                content = (item.get("message") or {}).get("content")
                if isinstance(content, str) and content.strip():
                    last = content
                elif isinstance(content, list):
                    texts = [b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"]
                    if texts and not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in content):
                        last = "\n".join(texts)
    except OSError:
        return None
    return last


def on_stop(agent: str, payload: dict, h: Path, bridge: Bridge) -> None:
    session = str(payload.get("session_id") or "default")
    answer = payload.get("last_assistant_message")
    state_path = _state_file(h, agent, session)
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        state = {}
    prompt = state.get("prompt")
    if not prompt and payload.get("transcript_path"):
        prompt = last_user_prompt(Path(payload["transcript_path"]))
    if not answer or not str(answer).strip() or not prompt:
        _log(h, f"{agent} stop: nothing to capture (prompt {'found' if prompt else 'missing'}, "
                f"answer {'found' if answer else 'missing'})")
        return
    turn = state.get("turn") or payload.get("turn_id") or payload.get("prompt_id")
    body = {"source": agent, "actor": "local", "owner": "local", "conversation": session, "prompt": prompt,
            "response": str(answer), "model": f"{agent}-agent"}
    if turn:
        body["message_ref"] = str(turn)
    bridge.send("POST", "/v1/captures", body)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    h = home()
    try:
        agent, event = argv[0], argv[1]
        if agent not in AGENTS or event not in ("prompt", "stop"):
            raise ValueError(f"usage: python -m rlfleet.bridge.hook {'|'.join(AGENTS)} prompt|stop")
        raw = sys.stdin.buffer.read(MAX_STDIN + 1)
        if len(raw) > MAX_STDIN:
            raise ValueError("hook input over 4 MB")
        payload = json.loads(raw or b"{}")
        bridge = Bridge(h, settings(h))
        if event == "prompt":
            out = on_prompt(agent, payload, h, bridge)
            if out is not None:
                sys.stdout.write(json.dumps(out))
        else:
            on_stop(agent, payload, h, bridge)
    except Exception:  # never fail the agent: the reason goes to our log
        _log(h, "hook failed: " + traceback.format_exc(limit=3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
