"""Recording fakes of the platforms' remote APIs and of an OpenAI-compatible responder, served by
aiohttp on 127.0.0.1 (port 0) inside the test's event loop. Nothing here talks to a real host."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

from aiohttp import web

from rlfleet.shared.webserver import listening


@dataclass
class Call:
    path: str
    body: dict[str, Any]


def free_port() -> int:
    """A loopback port nothing listens on yet: where a platform that is down at first comes up later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DROP = "drop"  # an outage that closes the connection without an answer
GARBAGE = "garbage"  # an outage that answers 200 with a body no client can read


_Fake = TypeVar("_Fake", bound="FakeServer")


@dataclass
class FakeServer:
    """An aiohttp app on a loopback port (a free one unless given) that records every request it gets.
    :meth:`fail` makes the next requests an outage: an error status, or a dropped connection."""

    calls: list[Call] = field(default_factory=list)
    url: str = ""
    outage: list[tuple[int | str, str]] = field(default_factory=list)  # (status, DROP or GARBAGE; path suffix)
    _stack: AsyncExitStack = field(default_factory=AsyncExitStack)

    def routes(self, app: web.Application) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def start(self, port: int = 0) -> FakeServer:
        app = web.Application(middlewares=[self._outage])
        self.routes(app)
        port = await self._stack.enter_async_context(listening(app, "127.0.0.1", port))
        self.url = f"http://127.0.0.1:{port}"
        return self

    def fail(self, n: int, status: int | str = 500, path: str = "") -> None:
        """The next ``n`` requests whose path ends with ``path`` get ``status`` (or DROP, GARBAGE) and are not
        recorded as calls."""
        self.outage.extend([(status, path)] * n)

    @web.middleware
    async def _outage(self, request: web.Request, handler: Any) -> web.StreamResponse:
        hit = next((i for i, (_, path) in enumerate(self.outage) if request.path.endswith(path)), None)
        if hit is None:
            return await handler(request)
        fate, _ = self.outage.pop(hit)
        if fate == DROP:
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError  # aiohttp's way to end a handler whose peer is gone
        if fate == GARBAGE:
            return web.Response(text="<html>upstream hiccup</html>", content_type="text/html")
        return web.json_response({"ok": False, "error": "fake outage"}, status=int(fate))

    async def stop(self) -> None:
        await self._stack.aclose()

    async def __aenter__(self: _Fake) -> _Fake:
        """Started on a free port for the ``async with`` block, stopped after it."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def record(self, request: web.Request) -> dict[str, Any]:
        if request.method == "GET":
            body = dict(request.query)
            self.calls.append(Call(request.path, body))
            return body
        raw = await request.read()
        ctype = request.headers.get("Content-Type", "")
        if "json" in ctype:
            body = json.loads(raw or b"{}")
        else:
            body = {k: v[0] for k, v in parse_qs(raw.decode()).items()}
        self.calls.append(Call(request.path, body))
        return body

    def of(self, suffix: str) -> list[dict[str, Any]]:
        return [c.body for c in self.calls if c.path.endswith(suffix)]

    async def wait_for(self, suffix: str, n: int = 1, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.of(suffix)) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {n} call(s) to {suffix} in {timeout} s; got {[c.path for c in self.calls]}")
            await asyncio.sleep(0.02)
        return self.of(suffix)


@dataclass
class FakeSlack(FakeServer):
    bot_user: str = "UBOT"
    thread: list[dict] = field(default_factory=list)  # what conversations.replies returns
    _ts: Any = field(default_factory=lambda: itertools.count(1))

    socket: Any = None  # the Socket Mode websocket, once a client connected
    acks: list[dict] = field(default_factory=list)  # what the client sent back on it

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/api/{method}", self.api)
        app.router.add_post("/respond/{id}", self.respond)
        app.router.add_get("/link", self.link)

    async def link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.socket = ws
        await ws.send_str(json.dumps({"type": "hello", "num_connections": 1}))
        async for msg in ws:
            if msg.type == web.WSMsgType.TEXT:
                self.acks.append(json.loads(msg.data))
        return ws

    async def api(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        method = request.match_info["method"]
        if method == "auth.test":
            return web.json_response({"ok": True, "user_id": self.bot_user, "bot_id": "BBOT", "team_id": "T1",
                                      "user": "rlfleet", "url": "https://fake.slack/"})
        if method == "chat.postMessage":
            ts = f"1700000000.{next(self._ts):06d}"
            return web.json_response({"ok": True, "channel": body.get("channel"), "ts": ts,
                                      "message": {"text": body.get("text"), "ts": ts}})
        if method == "apps.connections.open":
            return web.json_response({"ok": True, "url": self.url.replace("http://", "ws://") + "/link"})
        if method == "conversations.replies":
            return web.json_response({"ok": True, "messages": self.thread})
        return web.json_response({"ok": True})

    async def respond(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.Response(text="ok")


@dataclass
class FakeOpenAI(FakeServer):
    """An OpenAI-compatible chat-completions server; ``ours`` adds rlfleet's extension object.
    ``scopes``: the X-Rlfleet-Scope header of each completion asked for (None when absent)."""

    scopes: list[str | None] = field(default_factory=list)
    ours: bool = True
    answer: Callable[[list[dict]], str] = lambda msgs: f"answer to: {msgs[-1]['content']}"
    finish_reason: str | None = "stop"
    context_chars: int | None = None  # a conversation longer than this is refused, as OpenAI does

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def complete(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        self.scopes.append(request.headers.get("X-Rlfleet-Scope"))
        if self.context_chars is not None and sum(len(m["content"]) for m in body["messages"]) > self.context_chars:
            return web.json_response({"error": {
                "message": f"This model's maximum context length is {self.context_chars} characters.",
                "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}},
                status=400)
        text = self.answer(body["messages"])
        data: dict[str, Any] = {
            "id": "chatcmpl-1", "object": "chat.completion", "model": body.get("model", "tiny"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": self.finish_reason}],
        }
        if self.ours:
            n = len(text.split())
            data["rlfleet"] = {"adapter_version": None, "token_ids": list(range(5, 5 + n)),
                               "logprobs": [-0.5] * n, "messages": body["messages"]}
        return web.json_response(data)


@dataclass
class FakeTelegram(FakeServer):
    """The Bot API at ``{url}/bot<token>/<method>``; ``bot_id`` / ``username`` are the bot's own."""

    bot_id: int = 999
    username: str = "rlfleet_bot"
    updates: list[dict] = field(default_factory=list)  # handed out once by getUpdates (long polling)
    _ids: Any = field(default_factory=lambda: itertools.count(1000))

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/bot{token}/{method}", self.api)

    async def api(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        method = request.match_info["method"]
        if method == "getMe":
            result: Any = {"id": self.bot_id, "is_bot": True, "first_name": "rlfleet", "username": self.username}
        elif method == "sendMessage":
            chat_id = int(body["chat_id"])
            result = {"message_id": next(self._ids), "date": int(time.time()),
                      "chat": {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"},
                      "from": {"id": self.bot_id, "is_bot": True, "first_name": "rlfleet"}, "text": body.get("text")}
        elif method == "getUpdates":
            result, self.updates = self.updates, []
            if not result:
                await asyncio.sleep(0.2)
        else:
            result = True
        return web.json_response({"ok": True, "result": result})


def _discord_user(uid: str, bot: bool = False) -> dict:
    return {"id": uid, "username": f"u{uid}", "discriminator": "0", "global_name": None, "avatar": None, "bot": bot}


@dataclass
class FakeDiscord(FakeServer):
    """Discord's REST API at ``{url}/api/v10`` and a gateway websocket at ``{url}/gateway`` (plain JSON
    text frames). :meth:`dispatch` pushes an op-0 event to the connected client."""

    bot_id: str = "999"
    guild: str = "111"
    channel: str = "222"
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    _ws: Any = None
    _seq: Any = field(default_factory=lambda: itertools.count(1))
    _ids: Any = field(default_factory=lambda: itertools.count(5000))

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/gateway", self.gateway)
        app.router.add_route("*", "/api/v10/{tail:.*}", self.api)

    @staticmethod
    def _json(data: Any, status: int = 200) -> web.Response:
        # discord.py treats a body as JSON only when the content type is exactly application/json
        return web.Response(body=json.dumps(data).encode(), status=status,
                            headers={"Content-Type": "application/json"})

    def message(self, mid: str, author: dict, content: str, **extra: Any) -> dict:
        return {"id": mid, "channel_id": self.channel, "guild_id": self.guild, "author": author, "content": content,
                "timestamp": "2026-11-23T00:00:00+00:00", "edited_timestamp": None, "tts": False,
                "mention_everyone": False, "mentions": [], "mention_roles": [], "attachments": [], "embeds": [],
                "pinned": False, "type": 0, "flags": 0, "components": [], **extra}

    async def api(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        tail = request.match_info["tail"]
        if tail == "gateway/bot":
            return self._json({"url": self.url.replace("http://", "ws://") + "/gateway", "shards": 1,
                               "session_start_limit": {"total": 1000, "remaining": 999, "reset_after": 0,
                                                       "max_concurrency": 1}})
        if tail == "users/@me":
            return self._json(_discord_user(self.bot_id, bot=True))
        if tail == "oauth2/applications/@me":
            return self._json({"id": self.bot_id, "name": "rlfleet", "icon": None, "description": "",
                               "bot_public": True, "bot_require_code_grant": False, "verify_key": "0",
                               "flags": 0, "owner": _discord_user("1")})
        if tail.startswith("applications/") and tail.endswith("/commands"):
            return self._json([])
        if tail.startswith("channels/") and "/messages/" in tail and request.method == "PATCH":  # an edit
            mid = tail.rsplit("/", 1)[1]
            return self._json(self.message(mid, _discord_user(self.bot_id, bot=True), body.get("content") or "",
                                           components=body.get("components") or []))
        if tail.startswith("channels/") and tail.endswith("/messages"):
            mid = str(next(self._ids))
            return self._json(self.message(mid, _discord_user(self.bot_id, bot=True), body.get("content", ""),
                                           message_reference=body.get("message_reference")))
        if tail.startswith("interactions/"):
            iid = tail.split("/")[1]
            return self._json({"interaction": {"id": iid, "type": 2, "activity_instance_id": None,
                                               "response_message_id": None, "response_message_loading": True,
                                               "response_message_ephemeral": True},
                               "resource": {"type": 5}})
        if tail.startswith("webhooks/"):
            return self._json(self.message(str(next(self._ids)), _discord_user(self.bot_id, bot=True),
                                           body.get("content", ""), flags=64))
        return self._json({})

    async def gateway(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self._ws = ws
        await ws.send_str(json.dumps({"op": 10, "d": {"heartbeat_interval": 45000}, "s": None, "t": None}))
        async for msg in ws:
            data = json.loads(msg.data)
            if data["op"] == 1:
                await ws.send_str(json.dumps({"op": 11, "d": None, "s": None, "t": None}))
            elif data["op"] == 6:
                await self.dispatch("RESUMED", {})
            elif data["op"] == 2:
                await self.dispatch("READY", {
                    "v": 10, "user": _discord_user(self.bot_id, bot=True), "guilds": [{"id": self.guild,
                                                                                     "unavailable": True}],
                    "session_id": "s1", "resume_gateway_url": self.url.replace("http", "ws") + "/gateway",
                    "application": {"id": self.bot_id, "flags": 0}, "private_channels": [], "relationships": []})
                await self.dispatch("GUILD_CREATE", {
                    "id": self.guild, "name": "g", "unavailable": False, "owner_id": "1", "large": False,
                    "member_count": 1, "members": [], "emojis": [], "features": [], "threads": [], "stickers": [],
                    "voice_states": [], "presences": [], "stage_instances": [], "guild_scheduled_events": [],
                    "roles": [{"id": self.guild, "name": "@everyone", "permissions": "0", "position": 0,
                               "color": 0, "hoist": False, "managed": False, "mentionable": False, "flags": 0}],
                    "channels": [{"id": self.channel, "type": 0, "name": "general", "position": 0,
                                  "permission_overwrites": []}]})
        return ws

    async def dispatch(self, event: str, data: dict) -> None:
        await self._ws.send_str(json.dumps({"op": 0, "t": event, "s": next(self._seq), "d": data}))


@dataclass
class FakeTeamsConnector(FakeServer):
    """The Bot Framework connector a Teams activity's ``serviceUrl`` points at: replies land here."""

    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/{tail:.*}", self.api)

    async def api(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response({"id": f"reply-{next(self._ids)}"})


@contextmanager
def in_thread(fake: FakeServer):
    """Run a fake on its own event loop in a thread: for code under test that does blocking HTTP."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(fake.start(), loop).result(10)
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(fake.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@dataclass
class FakeVLLM(FakeServer):
    """vLLM's runtime LoRA endpoints as documented (docs/features/lora.md, entrypoints/serve/lora)."""

    inplace: bool = True  # servers before load_inplace ignore the field
    api_key: str | None = None
    loaded: dict[str, str] = field(default_factory=dict)

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def _error(self, status: int, message: str, kind: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": status}},
                                 status=status)

    def _denied(self, request: web.Request) -> web.Response | None:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return None

    async def load(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        if (denied := self._denied(request)) is not None:
            return denied
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return self._error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in self.loaded and not (self.inplace and body.get("load_inplace")):
            return self._error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                    "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
        if not (Path(path) / "adapter_config.json").is_file():
            return self._error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        self.loaded[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        if (denied := self._denied(request)) is not None:
            return denied
        name = body.get("lora_name")
        if name not in self.loaded:
            return self._error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self.loaded[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


@dataclass
class FakeOllama(FakeServer):
    """Ollama's blob and create API (docs/api.md); from 0.34.1 it refuses LoRA adapters."""

    version: str = "0.33.0"
    blobs: dict[str, bytes] = field(default_factory=dict)
    models: dict[str, dict] = field(default_factory=dict)

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/api/version", self.get_version)
        app.router.add_route("HEAD", "/api/blobs/{digest}", self.has_blob)
        app.router.add_post("/api/blobs/{digest}", self.put_blob)
        app.router.add_post("/api/create", self.create)
        app.router.add_delete("/api/delete", self.delete)

    async def get_version(self, request: web.Request) -> web.Response:
        self.calls.append(Call(request.path, {}))
        return web.json_response({"version": self.version})

    async def has_blob(self, request: web.Request) -> web.Response:
        self.calls.append(Call(request.path, {"method": "HEAD"}))
        return web.Response(status=200 if request.match_info["digest"] in self.blobs else 404)

    async def put_blob(self, request: web.Request) -> web.Response:
        data = await request.read()
        digest = request.match_info["digest"]
        self.calls.append(Call(request.path, {"bytes": len(data)}))
        if digest != "sha256:" + hashlib.sha256(data).hexdigest():
            return web.json_response({"error": "digest mismatch"}, status=400)
        self.blobs[digest] = data
        return web.Response(status=201)

    async def create(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        if body.get("adapters") and tuple(int(x) for x in self.version.split(".")) >= (0, 34, 1):
            return web.json_response({"error": "LoRA adapters are no longer supported"}, status=400)
        if not body.get("from") and not body.get("files"):
            return web.json_response({"error": "neither 'from' or 'files' was specified"}, status=400)
        for digest in {**body.get("adapters", {}), **body.get("files", {})}.values():
            if digest not in self.blobs:
                return web.json_response({"error": f"blob {digest} not found"}, status=400)
        self.models[body["model"]] = body
        return web.json_response({"status": "success"})

    async def delete(self, request: web.Request) -> web.Response:
        body = await self.record(request)
        if self.models.pop(body.get("model"), None) is None:
            return web.json_response({"error": f"model '{body.get('model')}' not found"}, status=404)
        return web.json_response({})


@dataclass
class FakeBotFrameworkKeys(FakeServer):
    """The OpenID metadata and signing keys botbuilder fetches to verify an inbound token, per issuer
    (``/channel/...``, ``/emulator/...``): point ``ChannelValidation.open_id_metadata_endpoint`` and
    ``AuthenticationConstants.TO_BOT_FROM_EMULATOR_OPENID_METADATA_URL`` at :meth:`metadata_url`.
    botbuilder fetches them with blocking ``requests``: serve this with :func:`in_thread`."""

    jwks: dict[str, dict] = field(default_factory=dict)  # issuer name -> {"keys": [JWK, ...]}

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/{issuer}/.well-known/openidconfiguration", self.metadata)
        app.router.add_get("/{issuer}/keys", self.keys)

    def metadata_url(self, issuer: str) -> str:
        return f"{self.url}/{issuer}/.well-known/openidconfiguration"

    async def metadata(self, request: web.Request) -> web.Response:
        await self.record(request)
        issuer = request.match_info["issuer"]
        return web.json_response({"issuer": issuer, "jwks_uri": f"{self.url}/{issuer}/keys",
                                  "id_token_signing_alg_values_supported": ["RS256"]})

    async def keys(self, request: web.Request) -> web.Response:
        await self.record(request)
        return web.json_response(self.jwks.get(request.match_info["issuer"], {"keys": []}))
