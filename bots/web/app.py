"""The web app's HTTP side (aiohttp): the login, the chat page and its JSON API.

Every route but ``POST /login`` answers 401 without a valid session cookie or bearer token (a page
route with the login form as the 401's body), and changes nothing. An answer is streamed as NDJSON
lines while the model generates it; ratings, reasons and undo are the ingress use cases' events
(source ``web``, the data dir's owner), handed to the worker like the terminal chat's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from html import escape
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlfleet.shared.compute_thread import on_compute_thread_async
from rlfleet.shared.config import Config
from rlfleet.shared.errors import ConfigError, ContextTooLong
from rlfleet.shared.events import MAX_COMMENT_CHARS, MAX_ID_CHARS, MAX_TEXT_CHARS, describe_validation_error
from rlfleet.shared.ingress.grammar import thumb_of
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.ingress.usecases import Completion, Reply, Send, UseCases
from rlfleet.shared.models import model_slug
from rlfleet.shared.permissions import LOCAL_ACTOR, Action, Actor, PermissionTable
from rlfleet.shared.queue import EVENTS_QUEUE, QueueHandle
from rlfleet.shared.ratings_io import to_example
from rlfleet.shared.secrets_file import read_secret_file
from rlfleet.shared.status import build_status
from rlfleet.shared.store import RatingFilter, Store
from rlfleet.shared.workers import serving

from .dashboard import dashboard
from .login import COOKIE, session_cookie, valid_bearer, valid_session
from .metrics import CONTENT_TYPE, FleetCollector, exposition

log = logging.getLogger(__name__)

ME = Actor("web", LOCAL_ACTOR)  # the browser's user: whoever holds the data dir's login token
HISTORY_TURNS = 4  # earlier turns sent with a question, as in the terminal chat
MAX_BODY_BYTES = 1 << 20
MAX_ROW = (1 << 63) - 1  # the largest integer SQLite's INTEGER (and PostgreSQL's BIGINT) holds
STATIC = ("index.html", "common.js", "app.js", "style.css", "dashboard.html", "dashboard.js", "ratings.html",
          "ratings.js", "vendor/chart.umd.min.js")
PAGES = {"/dashboard": "dashboard.html", "/ratings": "ratings.html"}
# The admin actions the page offers (the owner is an admin of their own data dir).
ACTIONS: tuple[Action, ...] = ("train", "rollback", "promote", "pause", "resume")
HEADERS = {  # no inline script, no framing, no sniffing: chat text is only ever text
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

# Sends an event and returns the worker's answer (`rlfleet web` passes the CLI's).
Dispatch = Callable[[QueueHandle, Config, Any], dict]


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str = Field(max_length=MAX_TEXT_CHARS)


class Ask(BaseModel):
    """``POST /api/chat``: a message, the conversation it belongs to and its earlier turns."""

    model_config = ConfigDict(extra="forbid")
    conversation: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    history: list[Turn] = Field(default_factory=list, max_length=200)


class Rate(BaseModel):
    """``POST /api/rate``: a thumb, stars, or both (they must agree), with an optional comment."""

    model_config = ConfigDict(extra="forbid")
    conversation: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    capture: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    value: Literal[1, -1] | None = None
    stars: int | None = Field(None, ge=1, le=5)
    comment: str | None = Field(None, max_length=MAX_COMMENT_CHARS)


class Why(BaseModel):
    """``POST /api/why``: the reason (a chip's words or your own) for the rating of ``capture``."""

    model_config = ConfigDict(extra="forbid")
    conversation: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    capture: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    reason: str = Field(min_length=1, max_length=MAX_COMMENT_CHARS)


class Act(BaseModel):
    """``POST /api/command``: an admin action (train, rollback, promote, pause, resume); ``version`` for
    rollback (default: the parent) and promote."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=32)
    version: str | None = Field(None, min_length=1, max_length=64)


class Browse(BaseModel):
    """``GET /api/ratings``'s query: filters of the ratings browser (store.RatingFilter)."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field("", max_length=200)
    source: str = Field("", max_length=32)
    actor: str = Field("", max_length=MAX_ID_CHARS)
    value: int = Field(0, ge=-1, le=1)  # 1, -1, or 0 for both (a query string's "-1" is a str: no Literal)
    version: str = Field("", max_length=64)
    state: Literal["active", "replaced", "undone", "all"] = "active"
    limit: int = Field(50, ge=1, le=200)
    offset: int = Field(0, ge=0, le=MAX_ROW)


class Amend(BaseModel):
    """``POST /api/ratings/undo`` and ``/api/ratings/comment``: one stored rating, by id."""

    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=1, le=MAX_ROW)
    comment: str | None = Field(None, min_length=1, max_length=MAX_COMMENT_CHARS)


class _PageGone(BaseException):
    """Raised in the generating thread once the page that asked has gone away: it stops ``generate()``
    at its next token. A BaseException, so that the responder's ``except Exception`` (llama.cpp failing,
    torch answering instead) lets it through."""


class Undo(BaseModel):
    model_config = ConfigDict(extra="forbid")
    conversation: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    capture: str = Field(min_length=1, max_length=MAX_ID_CHARS)


@dataclass
class WebApp:
    """What the routes need: the config, the queue, the answering model and how to send an event."""

    cfg: Config
    handle: QueueHandle
    responder: Any  # shared.responder.LocalResponder, or anything with its answer() and current_version()
    dispatch: Dispatch
    token: str
    clock: Callable[[], float] = time.time
    # The token file: a token written there replaces the one above at the next request (a leaked
    # token is revoked without a restart, every browser logged out); one gone or unsafe lets nobody in.
    token_path: Path | None = None
    cases: UseCases = field(init=False)
    store: Store = field(init=False)
    _token_seen: tuple | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.cases = UseCases(PermissionTable.for_config(self.cfg), self.cfg.model, self.handle)
        self.store = Store(self.cfg.db_url)
        if self.token_path is not None:
            self._token_seen = _file_identity(self.token_path)

    def current_token(self) -> str | None:
        """The login token now (None: the token file is gone or unsafe, and no login is valid)."""
        if self.token_path is None:
            return self.token
        seen = _file_identity(self.token_path)
        if seen != self._token_seen:
            self._token_seen = seen
            try:
                self.token = read_secret_file(self.token_path, "the web login token")
            except (ConfigError, OSError, UnicodeDecodeError) as exc:
                log.warning("no login is valid until the token file is fixed: %s", exc)
                self.token = ""
        return self.token or None

    def status(self) -> dict:
        return build_status(self.cfg, self.store, self.handle.redis, model_slug(self.cfg.model))

    # ---- who is asking -------------------------------------------------------------------------------

    def authenticated(self, request: web.Request) -> bool:
        token = self.current_token()
        return token is not None and (valid_bearer(token, request.headers.get("Authorization"))
                                      or valid_session(token, request.cookies.get(COOKIE), self.clock()))

    # ---- events --------------------------------------------------------------------------------------

    async def handed(self, event: Any) -> dict:
        """Hand an event to the worker and return its answer. With an events worker alive, the wait for
        its answer runs in a thread, so other pages keep streaming; with none, the CLI's dispatch works
        the queue right here, which RQ does only on the main thread: the loop's own."""
        if serving(self.handle.redis, EVENTS_QUEUE):
            return await asyncio.to_thread(self.dispatch, self.handle, self.cfg, event)
        return self.dispatch(self.handle, self.cfg, event)

    async def send(self, outcome: Any) -> dict:
        """The worker's answer to the event a use case made, or the use case's refusal."""
        if isinstance(outcome, Send):
            return await self.handed(outcome.event)
        if isinstance(outcome, Reply):
            return {"ok": False, "message": outcome.text}
        return {"ok": False, "message": "not allowed"}


def _page(name: str) -> bytes:
    path = resources.files(__package__).joinpath("static")
    for part in name.split("/"):
        path = path.joinpath(part)
    return path.read_bytes()


def _login_page(message: str = "") -> str:
    note = f'<p class="error">{escape(message)}</p>' if message else ""
    return ("<!doctype html><html><head><meta charset=utf-8><title>rlfleet · log in</title>"
            '<link rel="stylesheet" href="/login.css"></head><body class="login">'
            "<h1>rlfleet</h1><p>Paste the login token <code>rlfleet web</code> printed "
            "(also in the data dir's <code>web-token</code> file).</p>"
            f'{note}<form method="post" action="/login"><input name="token" type="password" '
            'autocomplete="current-password" placeholder="login token" autofocus required>'
            '<button type="submit">Log in</button></form></body></html>')


LOGIN_CSS = b"""body.login{font:16px system-ui,sans-serif;max-width:28rem;margin:4rem auto;padding:0 1rem}
body.login input{width:100%;padding:.5rem;margin:.5rem 0}.error{color:#b00}"""


def _file_identity(path: Path) -> tuple | None:
    """What changes when a file is written again, replaced or chmod-ed (None: there is none)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"ok": False, "message": message}, status=status, headers=HEADERS)


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    """The request's JSON as ``model``, or an HTTPException with a clear message (nothing done)."""
    if "application/json" not in request.headers.get("Content-Type", ""):
        raise web.HTTPUnsupportedMediaType(text=json.dumps({"ok": False, "message": "send application/json"}),
                                           content_type="application/json")
    try:
        return model.model_validate(await request.json())
    except ValidationError as exc:
        raise web.HTTPBadRequest(text=json.dumps({"ok": False, "message": describe_validation_error(
            exc, "malformed request")}), content_type="application/json") from None
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"ok": False, "message": "the body is not JSON"}),
                                 content_type="application/json") from None


def build_app(state: WebApp) -> web.Application:
    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        # Logging out needs no login: a page whose session ran out still gets the login page, not JSON
        public = (request.method, request.path) in {("POST", "/login"), ("POST", "/logout"), ("GET", "/login.css")}
        if not public and not state.authenticated(request):
            if request.path.startswith("/api/") or request.method != "GET":
                return _json_error(401, "log in first: the token `rlfleet web` printed, as a Bearer header")
            return web.Response(status=401, text=_login_page(), content_type="text/html", headers=HEADERS)
        response = await handler(request)
        for k, v in HEADERS.items():
            response.headers.setdefault(k, v)
        return response

    async def login(request: web.Request) -> web.Response:
        form = await request.post()
        given = str(form.get("token") or "")
        token = state.current_token()
        if token is None or not valid_bearer(token, f"Bearer {given}"):
            await asyncio.sleep(0.5)  # a guesser gets two tries a second, not thousands
            return web.Response(status=401, text=_login_page("That is not the login token."),
                                content_type="text/html", headers=HEADERS)
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(COOKIE, session_cookie(token, state.clock(), state.cfg.web.session_hours),
                            httponly=True, samesite="Strict", path="/",
                            secure=request.secure, max_age=int(state.cfg.web.session_hours * 3600))
        return response

    async def logout(request: web.Request) -> web.Response:
        response = web.Response(status=303, headers={"Location": "/"})
        response.del_cookie(COOKIE, path="/")
        return response

    async def static(request: web.Request) -> web.Response:
        name = request.match_info.get("name") or PAGES.get(request.path, "index.html")
        if name not in STATIC:
            raise web.HTTPNotFound()
        kind = {"html": "text/html", "js": "text/javascript", "css": "text/css"}[name.rsplit(".", 1)[1]]
        return web.Response(body=_page(name), content_type=kind, charset="utf-8")

    async def login_css(request: web.Request) -> web.Response:
        return web.Response(body=LOGIN_CSS, content_type="text/css", headers=HEADERS)

    async def about(request: web.Request) -> web.Response:
        return web.json_response({"model": state.cfg.model, "version": state.responder.current_version(),
                                  "reasons": list(REASONS), "conversation": f"web-{uuid.uuid4().hex[:8]}",
                                  "max_text": MAX_TEXT_CHARS})

    async def chat(request: web.Request) -> web.StreamResponse:
        ask = await _body(request, Ask)
        messages = [t.model_dump() for t in ask.history[-2 * HISTORY_TURNS:]] + \
            [{"role": "user", "content": ask.text}]
        try:  # refused before the answer starts, as any bad request is: the page shows why, stores nothing
            messages = await asyncio.to_thread(state.responder.fit_history, messages)
        except ContextTooLong as exc:
            return _json_error(400, str(exc))
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", **HEADERS})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        gone = threading.Event()  # the page went away (a reload, a closed tab): stop generating

        def on_text(text: str) -> None:  # on the generating thread, at each token
            if gone.is_set():
                raise _PageGone
            loop.call_soon_threadsafe(pieces.put_nowait, text)

        def generate() -> Any:
            try:
                return state.responder.answer(messages, on_text=on_text,
                                              scope=state.cfg.scope_key_of(ME.source, ME.id, ask.conversation))
            finally:
                loop.call_soon_threadsafe(pieces.put_nowait, None)

        async def line(obj: dict) -> None:
            if gone.is_set():
                return
            try:
                await response.write((json.dumps(obj) + "\n").encode())
            except ConnectionError:  # aiohttp's ClientConnectionResetError: the page hung up
                gone.set()

        job = asyncio.create_task(on_compute_thread_async(generate))  # (rlfleet.shared.compute_thread)
        while (piece := await pieces.get()) is not None:
            await line({"type": "text", "text": piece})
        try:
            answer = await job
        except _PageGone:
            log.info("web chat: the page went away mid-answer; its answer stopped there")
            return response
        except Exception as exc:  # noqa: BLE001 - the model failed: said on the page, the app goes on
            log.exception("web chat: the model failed")
            await line({"type": "error", "message": f"the model failed: {exc.__class__.__name__}"})
            return response
        if gone.is_set():  # the page never saw it: nothing to capture or rate
            log.info("web chat: the page went away before its answer was done")
            return response
        done: dict[str, Any] = {"type": "done", "text": answer.text, "version": answer.adapter_version,
                                "capture": None}
        if answer.text.strip():
            try:
                cap = state.cases.capture_event(ME, ask.conversation, messages,
                                                Completion.ours_from(answer, state.cfg.model))
                result = await state.handed(cap)
                if result.get("ok"):
                    done["capture"] = cap.capture_id
                else:
                    done["note"] = f"not captured: {result.get('message')}"
            except ValueError as exc:  # an answer the event contract refuses: shown, not rateable
                done["note"] = (describe_validation_error(exc, "not captured") if isinstance(exc, ValidationError)
                                else f"not captured: {exc}")
        else:
            done["note"] = "empty answer: nothing to rate"
        await line(done)
        return response

    async def respond(result: dict) -> web.Response:
        return web.json_response({"ok": bool(result.get("ok")), "message": str(result.get("message", "")),
                                  "training": result.get("training")}, status=200 if result.get("ok") else 409)

    async def rate(request: web.Request) -> web.Response:
        r = await _body(request, Rate)
        if r.value is None and r.stars is None:
            return _json_error(400, "give a value (1 or -1), stars (1-5), or both")
        value = r.value if r.value is not None else thumb_of(r.stars)
        try:
            outcome = state.cases.rate(ME, r.conversation, value, r.comment, target=r.capture, stars=r.stars)
        except ValidationError as exc:  # stars that disagree with the thumb
            return _json_error(400, describe_validation_error(exc, "could not record that"))
        return await respond(await state.send(outcome))

    async def why(request: web.Request) -> web.Response:
        w = await _body(request, Why)
        try:
            outcome = state.cases.why(ME, w.conversation, w.reason, target=w.capture)
        except ValidationError as exc:
            return _json_error(400, describe_validation_error(exc, "could not record that"))
        return await respond(await state.send(outcome))

    async def undo(request: web.Request) -> web.Response:
        u = await _body(request, Undo)
        return await respond(await state.send(state.cases.undo(ME, u.conversation, u.capture)))

    async def board(request: web.Request) -> web.Response:
        data = await asyncio.to_thread(dashboard, state.cfg, state.store, state.handle)
        return web.json_response(data, dumps=lambda d: json.dumps(d, default=str))

    async def command(request: web.Request) -> web.Response:
        a = await _body(request, Act)
        if a.name not in ACTIONS:
            return _json_error(400, f"unknown action {a.name[:32]!r}: one of {', '.join(ACTIONS)}")
        args = {"version": a.version} if a.version else {}
        name = next(n for n in ACTIONS if n == a.name)  # the Action literal the use case takes
        return await respond(await state.send(state.cases.command(ME, name, args)))

    async def export(request: web.Request) -> web.Response:
        pairs = await asyncio.to_thread(state.store.rated_pairs, model_slug(state.cfg.model))
        body = "".join(to_example(r, c).model_dump_json(exclude_none=True) + "\n" for r, c in pairs)
        return web.Response(body=body.encode(), content_type="application/x-ndjson", headers={
            "Content-Disposition": 'attachment; filename="rlfleet-ratings.jsonl"'})

    async def browse(request: web.Request) -> web.Response:
        try:
            q = Browse.model_validate(dict(request.query))
        except ValidationError as exc:
            return _json_error(400, describe_validation_error(exc, "malformed filter"))
        total, rows = await asyncio.to_thread(state.store.browse_ratings, model_slug(state.cfg.model),
                                              RatingFilter(**q.model_dump()))
        return web.json_response({"total": total, "ratings": [asdict(r) for r in rows]},
                                 dumps=lambda d: json.dumps(d, default=str))

    async def amend(request: web.Request) -> web.Response:
        """Undo a stored rating, or give it new words, as the person who made it: the owner of the data
        dir stands in for them (the event still names them, so their other ratings are untouched)."""
        a = await _body(request, Amend)
        found = state.store.rating_ref(a.id)
        if found is None:
            return _json_error(404, f"no rating {a.id}")
        source, actor, capture, row_state = found
        if row_state != "active":
            return _json_error(409, f"rating {a.id} is {row_state}: only the active rating of an answer changes")
        who = Actor(source, actor)
        if request.path.endswith("/undo"):
            outcome = state.cases.undo(who, None, capture)
        elif a.comment is None:
            return _json_error(400, "give the new comment")
        else:
            outcome = state.cases.why(who, None, a.comment, target=capture)
        return await respond(await state.send(outcome))

    async def metrics(request: web.Request) -> web.Response:
        collector = FleetCollector(state.store, model_slug(state.cfg.model), state.status)
        body = await asyncio.to_thread(exposition, collector)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(middlewares=[guard], client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/login", login)
    app.router.add_get("/login.css", login_css)
    app.router.add_post("/logout", logout)
    app.router.add_get("/", static)
    app.router.add_get("/dashboard", static)
    app.router.add_get("/ratings", static)
    app.router.add_get("/api/ratings", browse)
    app.router.add_post("/api/ratings/undo", amend)
    app.router.add_post("/api/ratings/comment", amend)
    app.router.add_get("/static/{name:.+}", static)
    app.router.add_get("/api/dashboard", board)
    app.router.add_post("/api/command", command)
    app.router.add_get("/api/export", export)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/api/about", about)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/rate", rate)
    app.router.add_post("/api/why", why)
    app.router.add_post("/api/undo", undo)
    return app
