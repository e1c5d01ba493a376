"""`rlfleet bridge`: the local HTTP ingress for agents, hooks and gateways.

Every request but ``/health`` and ``/openapi.json`` is signed (`bridge/auth.py`); a replayed signature,
a stale timestamp, an unknown key, a body over the limit or one that does not validate changes
nothing and gets a one-line JSON error. A valid request becomes one typed event on the Redis queue,
answered 202 with its event id (``?wait=SECONDS`` also returns the worker's answer when it comes in
time). The bridge never trains and never opens the database: status is the worker's snapshot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import TypeVar

import redis
from aiohttp import web
from pydantic import BaseModel, ValidationError

from rlfleet.shared.config import Config
from rlfleet.shared.errors import ConfigError
from rlfleet.shared.events import Capture, Message, describe_validation_error, finish_reason
from rlfleet.shared.ingress.grammar import thumb_of
from rlfleet.shared.ingress.replies import NO_STATUS
from rlfleet.shared.ingress.usecases import Reply, Send, UseCases, Value
from rlfleet.shared.models import model_slug
from rlfleet.shared.permissions import Actor, PermissionTable
from rlfleet.shared.queue import QueueHandle, enqueue_event, status_key, wait_for
from rlfleet.shared.secrets_file import read_secret, read_secret_file

from . import spool
from .api import CaptureIn, CommandIn, RatingIn, UndoIn, openapi
from .auth import KEY_HEADER, MAX_SKEW_S, SIGNATURE_HEADER, verify

log = logging.getLogger(__name__)
MAX_WAIT_S = 10.0
SPOOL_POLL_S = 5.0
_BODIES: dict[str, type[CaptureIn | RatingIn | UndoIn | CommandIn]] = {
    "/v1/captures": CaptureIn, "/v1/ratings": RatingIn, "/v1/undo": UndoIn, "/v1/commands": CommandIn}
_In = TypeVar("_In", bound=BaseModel)


@dataclass(frozen=True)
class Key:
    id: str
    secret: str
    admin: bool


def load_keys(cfg: Config) -> dict[str, Key]:
    """``local`` (the data dir's 0600 secret file, an admin key) and the configured gateway keys."""
    if not cfg.secret_path.exists():
        raise ConfigError(f"no secret file {cfg.secret_path}: run `rlfleet init` first")
    keys = {"local": Key("local", read_secret_file(cfg.secret_path, "the bridge secret"), True)}
    for k in cfg.bridge.keys:
        secret = read_secret(k.secret_env, k.secret_file, f"bridge key {k.id}")
        keys[k.id] = Key(k.id, secret, k.admin)
    return keys


def acting_as(key: Key, name: str | None) -> str:
    """The actor (or owner) a request signed by ``key`` names, as the store knows them. An admin key,
    the data dir's own among them, vouches for whoever it names; a gateway key's people are its own,
    ``gw:alice`` for key ``gw``, so that it reaches neither the data dir's owner (``local``), a chat
    platform's users nor another key's people (a key id holds no colon: shared/config.BridgeKey)."""
    if name is None or name == key.id:
        return key.id
    return name if key.admin else f"{key.id}:{name}"


def visible_status(status: dict, key: Key) -> dict:
    """What ``key`` may read of the status: an admin key all of it; a gateway key the scopes of its own
    people only (``…:gw:alice``), not every person's id and counts."""
    if key.admin:
        return status
    mine = {k: v for k, v in (status.get("scopes") or {}).items()
            if k.startswith("person:") and k.split(":", 2)[-1].startswith(f"{key.id}:")}
    return {**status, "scopes": mine}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class Bridge:
    def __init__(self, cfg: Config, handle: QueueHandle, keys: dict[str, Key]) -> None:
        self.cfg, self.handle, self.keys = cfg, handle, keys
        self.slug = model_slug(cfg.model)
        # A request acts as its key: commands as the key itself, which the table makes an admin when the
        # key is one; data events as the actor the key vouches for (default: the key).
        table = PermissionTable.for_config(cfg, admin_keys=[k.id for k in keys.values() if k.admin])
        self.cases = UseCases(table, cfg.model, handle)

    # ---- the checks every signed request passes -------------------------------------------------

    async def authenticate(self, request: web.Request) -> tuple[Key, bytes] | web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over {self.cfg.bridge.max_body_bytes:,} bytes")
        key = self.keys.get(request.headers.get(KEY_HEADER, "local"))
        if key is None:
            return _error(401, "unknown key")
        why = verify(key.secret, dict(request.headers), request.method, request.path_qs, body)
        if why:
            return _error(401, why)
        redis = self.handle.redis
        # A signature is single-use: a replay within the freshness window is refused here, and the
        # event id makes any repeat that slips past a no-op in the store.
        if not redis.set(f"rlfleet:bridge:seen:{request.headers[SIGNATURE_HEADER]}", 1, nx=True, ex=2 * MAX_SKEW_S):
            return _error(401, "replayed request")
        window = f"rlfleet:bridge:rate:{key.id}:{int(time.time())}"
        count = redis.incr(window)
        if count == 1:
            redis.expire(window, 2)
        if count > self.cfg.bridge.rate_limit:
            return _error(429, f"over {self.cfg.bridge.rate_limit} requests per second for key {key.id}")
        return key, body

    async def _accept(self, request: web.Request, event, capture_id: str | None = None) -> web.Response:
        ticket = enqueue_event(self.handle, event)
        result = None
        try:
            wait = min(float(request.query.get("wait", 0) or 0), MAX_WAIT_S)
        except ValueError:
            wait = 0.0
        if wait > 0:
            result = await asyncio.to_thread(wait_for, ticket, wait)
        body = {"ok": True, "event_id": event.event_id, "capture_id": capture_id, "result": result}
        return web.json_response(body, status=202)

    def _parse(self, model: type[_In], raw: bytes) -> _In | web.Response:
        try:
            return model.model_validate_json(raw or b"{}")
        except ValidationError as exc:
            return _error(422, describe_validation_error(exc, "invalid body"))

    # ---- endpoints ---------------------------------------------------------------------------------

    def build_event(self, path: str, raw: bytes, key: Key):
        """The typed event a signed request (or a spooled one) stands for: ``(event, capture_id)``, or
        the error response."""
        body = self._parse(_BODIES[path], raw)
        if isinstance(body, web.Response):
            return body
        who = Actor(body.source, acting_as(key, body.actor))
        try:
            if isinstance(body, CaptureIn):
                return self._capture(body, who, acting_as(key, body.owner or body.actor))
            if isinstance(body, RatingIn) and body.value is None and body.stars is None:
                out = self.cases.why(who, body.conversation, body.comment, target=body.target, event_id=body.event_id)
                if isinstance(out, Reply):
                    return _error(422, f"invalid body: {out.text}")
            elif isinstance(body, RatingIn):
                value: Value = (thumb_of(body.stars) if body.value is None and body.stars is not None
                                else 1 if body.value in ("good", 1) else -1)
                out = self.cases.rate(who, body.conversation, value, body.comment, target=body.target,
                                      event_id=body.event_id, stars=body.stars)
            elif isinstance(body, UndoIn):
                out = self.cases.undo(who, body.conversation, body.target, body.event_id)
            else:  # a command is the key's own act, whoever it names
                out = self.cases.command(Actor(body.source, key.id), body.name, body.args, body.event_id)
                if not isinstance(out, Send):
                    return _error(403, f"/rl {body.name} needs an admin key; key {key.id} is not one")
        except ValidationError as exc:
            return _error(422, describe_validation_error(exc, "invalid body"))
        if not isinstance(out, Send):  # not reached: a named actor may always rate its own answers and undo
            return _error(403, "not permitted")
        return out.event, None

    @staticmethod
    def _capture(body: CaptureIn, who: Actor, owner: str) -> tuple[Capture, str]:
        """An answer produced elsewhere, recorded as the sender says (no permission needed)."""
        prompt = [Message(role="user", content=body.prompt)] if isinstance(body.prompt, str) else body.prompt
        extra = {k: v for k, v in (("event_id", body.event_id), ("capture_id", body.capture_id)) if v}
        ev = Capture(source=body.source, actor=who.id, owner=owner, conversation=body.conversation,
                     message_ref=body.message_ref, prompt=prompt, response=body.response, model=body.model,
                     finish_reason=finish_reason(body.finish_reason), **extra)
        return ev, ev.capture_id

    async def submit(self, request: web.Request) -> web.Response:
        auth = await self.authenticate(request)
        if isinstance(auth, web.Response):
            return auth
        key, raw = auth
        built = self.build_event(request.path, raw, key)
        if isinstance(built, web.Response):
            return built
        event, capture_id = built
        return await self._accept(request, event, capture_id)

    def drain_spool(self) -> tuple[int, int]:
        """Requests the hooks spooled while the bridge was down, into the queue in their order."""

        def send(method: str, path: str, body: dict) -> None:
            built = self.build_event(path, json.dumps(body).encode(), self.keys["local"])
            if isinstance(built, web.Response):
                raise ValueError(built.text)
            try:
                enqueue_event(self.handle, built[0])
            except redis.RedisError as exc:  # keep the line for the next try
                raise ConnectionError(str(exc)) from None

        sent, dropped = spool.drain(self.cfg.home, send)
        if sent or dropped:
            log.info("spool: %d requests queued, %d invalid ones dropped", sent, dropped)
        return sent, dropped

    async def status(self, request: web.Request) -> web.Response:
        auth = await self.authenticate(request)
        if isinstance(auth, web.Response):
            return auth
        raw = self.handle.redis.get(status_key(self.slug))
        if not raw:
            return _error(503, NO_STATUS)
        return web.json_response(visible_status(json.loads(raw), auth[0]))


BRIDGE: web.AppKey[Bridge] = web.AppKey("bridge", Bridge)


@web.middleware
async def _no_traces(request: web.Request, handler) -> web.StreamResponse:
    """A clear JSON error for anything that goes wrong; the trace only in our log."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            return _error(413, "body too large")
        return _error(exc.status, exc.reason or "error")
    except redis.RedisError as exc:  # the queue is down, not the request wrong: a client may retry
        log.warning("bridge request not queued: Redis is not answering (%s)", type(exc).__name__)
        return _error(503, "the queue (Redis) is not answering: nothing was recorded, try again")
    except Exception:
        log.exception("bridge request failed")
        return _error(500, "internal error (see the bridge's log)")


def make_app(cfg: Config, handle: QueueHandle, keys: dict[str, Key] | None = None) -> web.Application:
    bridge = Bridge(cfg, handle, keys if keys is not None else load_keys(cfg))
    spec = openapi()

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def describe(request: web.Request) -> web.Response:
        return web.json_response(spec)

    app = web.Application(client_max_size=cfg.bridge.max_body_bytes, middlewares=[_no_traces])
    app.router.add_get("/health", health)
    app.router.add_get("/openapi.json", describe)
    for path in ("/v1/captures", "/v1/ratings", "/v1/undo", "/v1/commands"):
        app.router.add_post(path, bridge.submit)
    app.router.add_get("/v1/status", bridge.status)

    async def drain_forever(app: web.Application):
        async def loop() -> None:
            while True:
                try:
                    await asyncio.to_thread(bridge.drain_spool)
                except Exception:
                    log.exception("draining the spool failed")
                await asyncio.sleep(SPOOL_POLL_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    app.cleanup_ctx.append(drain_forever)
    app[BRIDGE] = bridge
    return app
