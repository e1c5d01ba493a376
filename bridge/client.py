"""A small client for the bridge, for gateway plugins and scripts (standard library only).

    from rlfleet.bridge.client import BridgeClient
    bridge = BridgeClient.from_data_dir()            # 127.0.0.1:8765, the data dir's secret
    cap = bridge.capture("what is a monad?", "A monad is ...", conversation="chat-42", message_ref="m-7")
    bridge.rate("m-7", "good", conversation="chat-42", comment="clear")
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

from .auth import sign


class BridgeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class BridgeClient:
    def __init__(self, url: str = "http://127.0.0.1:8765", secret: str = "", key: str = "local",
                 timeout: float = 5.0) -> None:
        if not secret:
            raise ValueError("a bridge client needs the secret (the data dir's `secret` file for key `local`)")
        self.url, self.secret, self.key, self.timeout = url.rstrip("/"), secret, key, timeout

    @classmethod
    def from_data_dir(cls, home: Path | None = None, **kw: object) -> BridgeClient:
        from rlfleet.shared.config import load_config
        from rlfleet.shared.secrets_file import read_secret_file

        cfg = load_config(home)
        host = "127.0.0.1" if cfg.bridge.host in ("0.0.0.0", "::") else cfg.bridge.host
        url = str(kw.pop("url", f"http://{host}:{cfg.bridge.port}"))
        return cls(url, read_secret_file(cfg.secret_path, "the bridge secret"), **kw)  # type: ignore[arg-type]

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        raw = json.dumps(body).encode() if body is not None else b""
        headers = {"Content-Type": "application/json", **sign(self.secret, method, path, raw, self.key)}
        req = urllib.request.Request(self.url + path, data=raw if body is not None else None, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", exc.reason)
            except ValueError:
                message = str(exc.reason)
            raise BridgeError(exc.code, message) from None

    def capture(self, prompt: str | list[dict], response: str, conversation: str = "default",
                message_ref: str | None = None, **fields: object) -> dict:
        body = {"prompt": prompt, "response": response, "conversation": conversation, "message_ref": message_ref}
        return self.request("POST", "/v1/captures", {**body, **fields})

    def rate(self, target: str, value: str | int, conversation: str | None = None, comment: str | None = None,
             wait: float = 0, **fields: object) -> dict:
        body = {"target": target, "value": value, "conversation": conversation, "comment": comment, **fields}
        return self.request("POST", "/v1/ratings" + (f"?wait={wait:g}" if wait else ""), body)

    def undo(self, target: str | None = None, conversation: str | None = None, wait: float = 0,
             **fields: object) -> dict:
        body = {"target": target, "conversation": conversation, **fields}
        return self.request("POST", "/v1/undo" + (f"?wait={wait:g}" if wait else ""), body)

    def command(self, name: str, wait: float = 0, **args: object) -> dict:
        return self.request("POST", "/v1/commands" + (f"?wait={wait:g}" if wait else ""), {"name": name, "args": args})

    def status(self) -> dict:
        return self.request("GET", "/v1/status")
