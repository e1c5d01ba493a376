"""Slack: slack-bolt's AsyncApp, Socket Mode by default (no public URL) or HTTP (`--http`).

Translation only: Slack payloads -> :class:`BotCore` calls -> Slack replies. Bolt verifies request
signatures (HTTP mode) and drops the bot's own events before a listener runs; every listener acks
first, so Slack gets its answer within 3 s and the work happens after.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl

from aiohttp import web
from slack_bolt.async_app import AsyncApp
from slack_bolt.middleware.async_middleware import AsyncMiddleware
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_bolt.response import BoltResponse
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from rlfleet.shared.config import Config, SlackSettings
from rlfleet.shared.errors import ConfigError
from rlfleet.shared.ingress.grammar import reaction_value, stars_of, thumb_of
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.secrets_file import read_secret
from rlfleet.shared.webserver import listening, until_cancelled

from .core import BotCore, Reply
from .supervisor import Link, supervise

log = logging.getLogger(__name__)

GOOD_ACTION, BAD_ACTION = "rl_good", "rl_bad"
STARS_ACTION = "rl_stars"  # the 1-5 stars control beside the buttons
REASON_ACTION = "rl_why_"  # + the reason's number in shared/ingress/reasons.REASONS
MAX_BODY_BYTES = 1 << 20  # Slack's payloads are a few kB; anything near this is not from Slack
_MENTION = re.compile(r"<@[A-Z0-9]+>\s*")


def answer_blocks(text: str, buttons: bool) -> list[dict] | None:
    """The answer as Block Kit: its text, and good/bad buttons under it when on."""
    if not buttons:
        return None
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}},
        {"type": "actions", "block_id": "rl_rate", "elements": [
            {"type": "button", "action_id": GOOD_ACTION, "text": {"type": "plain_text", "text": "👍 good"},
             "value": "1"},
            {"type": "button", "action_id": BAD_ACTION, "text": {"type": "plain_text", "text": "👎 bad"},
             "value": "-1"},
            {"type": "static_select", "action_id": STARS_ACTION, "placeholder": {"type": "plain_text", "text": "★ 1-5"},
             "options": [{"text": {"type": "plain_text", "text": "★" * n}, "value": str(n)} for n in range(5, 0, -1)]},
        ]},
    ]


def build_app(core: BotCore, token: str, signing_secret: str | None, api_base: str | None = None) -> AsyncApp:
    """Bolt's app with the bot's listeners registered: `/rl`, messages, reactions and rating buttons."""
    client = AsyncWebClient(token=token, base_url=api_base) if api_base else AsyncWebClient(token=token)
    app = AsyncApp(
        client=client,
        signing_secret=signing_secret or "",
        # Socket Mode has no signatures to check; HTTP mode always checks them.
        request_verification_enabled=signing_secret is not None,
    )
    app.use(RefuseMalformed())
    register_command(app, core)
    register_messages(app, core)
    register_reactions(app, core)
    register_buttons(app, core)
    return app


def well_formed(body: Any) -> bool:
    """Whether bolt's own listener matching can read the payload: it indexes a button press's first
    ``action_id`` and an event's ``type`` without checking they are there, and raised inside its
    dispatch (an HTTP 500) on a payload that lacked them."""
    if not isinstance(body, dict):
        return False
    if body.get("type") == "block_actions" and "actions" in body:
        actions = body["actions"]
        return (isinstance(actions, list) and bool(actions)
                and all(isinstance(a, dict) and isinstance(a.get("action_id"), str) for a in actions))
    if "event" in body:
        return isinstance(body["event"], dict)
    return True


class RefuseMalformed(AsyncMiddleware):
    """Bolt's first global middleware: a payload its matchers cannot read gets a 400 and reaches no
    listener. A class, not a function: bolt builds a function middleware's arguments from the payload
    with the same unchecked reads."""

    async def async_process(self, *, req: AsyncBoltRequest, resp: BoltResponse,
                            next: Callable[[], Awaitable[BoltResponse]]) -> BoltResponse:
        if not well_formed(req.body):
            return BoltResponse(status=400, body={"error": "malformed payload"})
        await next()
        return resp


async def respond_private(respond: Any, reply: Reply | None) -> None:
    if reply is not None:
        await respond(text=reply.text, response_type="ephemeral", replace_original=False)


def register_command(app: AsyncApp, core: BotCore) -> None:
    """`/rl`, answered privately to whoever ran it."""

    @app.command("/rl")
    async def rl_command(ack: Any, body: dict, respond: Any) -> None:
        await ack()
        reply = await core.command(body.get("user_id"), body.get("channel_id", ""), body.get("text") or "")
        await respond_private(respond, reply)


async def answer_message(core: BotCore, settings: SlackSettings, event: dict, client: AsyncWebClient,
                         bot_user_id: str | None) -> None:
    """Answer the message ``event`` in its thread (with the thread so far as context) and capture it."""
    channel, user = event.get("channel"), event.get("user")
    if not channel or not user or event.get("bot_id") or event.get("subtype"):
        return
    if core.seen(f"msg:{channel}:{event.get('ts')}"):
        return  # a DM mention arrives as both `message` and `app_mention`; retries too
    text = _MENTION.sub("", event.get("text") or "").strip()
    if not text:
        return
    thread = event.get("thread_ts") or event["ts"]
    context: list[tuple[bool, str]] = []
    if event.get("thread_ts") and settings.context_messages:
        replies = await client.conversations_replies(channel=channel, ts=event["thread_ts"],
                                                     limit=settings.context_messages + 1)
        messages: list[dict[str, Any]] = replies.get("messages", [])
        for m in messages:
            if m.get("ts") != event["ts"]:
                by_bot = bool(m.get("bot_id")) or m.get("user") == bot_user_id
                context.append((by_bot, _MENTION.sub("", m.get("text") or "")))

    async def post(answer: str) -> str:
        posted = await client.chat_postMessage(channel=channel, thread_ts=thread, text=answer,
                                               blocks=answer_blocks(answer, settings.buttons))
        core.posted.remember_thread(core.source, channel, thread)
        return posted["ts"]

    async def fail(why: str) -> None:
        await client.chat_postMessage(channel=channel, thread_ts=thread, text=why)

    await core.answer_and_capture(user, channel, text, post, fail, context)


def register_messages(app: AsyncApp, core: BotCore) -> None:
    """Mentions anywhere the bot answers; DMs, and replies in the threads it answered in."""
    settings: SlackSettings = core.settings  # type: ignore[assignment]

    @app.event("app_mention")
    async def on_mention(event: dict, client: AsyncWebClient, context: dict) -> None:
        if core.answers_in(event.get("channel", ""), is_dm=False):
            await answer_message(core, settings, event, client, context.get("bot_user_id"))

    @app.event("message")
    async def on_message(event: dict, client: AsyncWebClient, context: dict) -> None:
        channel = event.get("channel", "")
        is_dm = event.get("channel_type") == "im"
        in_our_thread = bool(event.get("thread_ts")) and core.posted.in_thread(core.source, channel,
                                                                                event["thread_ts"])
        mentioned = f"<@{context.get('bot_user_id')}>" in (event.get("text") or "")
        if (is_dm or (in_our_thread and not mentioned)) and core.answers_in(channel, is_dm):
            await answer_message(core, settings, event, client, context.get("bot_user_id"))


ASK_WHY_AFTER_REACTION = "👎 noted."


def register_reactions(app: AsyncApp, core: BotCore) -> None:
    """A thumb added to an answer rates it; removing it takes the rating back. A 👎 that counted is
    followed by the one-click reasons, shown to whoever reacted only (an ephemeral message)."""

    async def on_reaction(event: dict, added: bool) -> bool:
        item = event.get("item") or {}
        value = reaction_value(event.get("reaction"))
        if item.get("type") != "message" or value is None:
            return False
        return await core.reaction(event.get("user"), item.get("channel", ""), item.get("ts", ""),
                                   old=None if added else value, new=value if added else None)

    @app.event("reaction_added")
    async def reaction_added(event: dict, client: AsyncWebClient) -> None:
        if await on_reaction(event, added=True) and reaction_value(event.get("reaction")) == -1:
            item = event.get("item") or {}
            try:
                await client.chat_postEphemeral(
                    channel=item.get("channel", ""), user=event.get("user", ""), text=ASK_WHY_AFTER_REACTION,
                    blocks=reason_blocks(ASK_WHY_AFTER_REACTION, str(item.get("ts", ""))))
            except (SlackApiError, OSError, asyncio.TimeoutError) as exc:  # the rating stands without it
                log.warning("could not offer the reasons after a 👎 reaction: %s", type(exc).__name__)

    @app.event("reaction_removed")
    async def reaction_removed(event: dict) -> None:
        await on_reaction(event, added=False)


def reason_blocks(text: str, message_ref: str) -> list[dict]:
    """A private reply to a 👎 with the one-click reasons under it, each naming the answer it is about."""
    return [
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{text[:2900]}\nWhy? (or type `/rl why <words>`)"}},
        {"type": "actions", "block_id": "rl_why", "elements": [
            {"type": "button", "action_id": f"{REASON_ACTION}{i}", "text": {"type": "plain_text", "text": reason},
             "value": message_ref[:2000]} for i, reason in enumerate(REASONS, 1)
        ]},
    ]


def register_buttons(app: AsyncApp, core: BotCore) -> None:
    """The good/bad buttons under an answer, answered privately to whoever pressed one; a 👎's reply
    offers the reasons, and a reason pressed replaces that reply with the answer to it."""

    async def on_button(ack: Any, body: dict, respond: Any, value: int, stars: int | None = None) -> None:
        await ack()
        ref = (body.get("message") or {}).get("ts", "")
        reply = await core.button(
            (body.get("user") or {}).get("id"), (body.get("channel") or {}).get("id", ""), ref,
            value,  # type: ignore[arg-type]
            stars=stars,
        )
        if reply is not None and reply.ask_why and isinstance(ref, str) and ref:
            await respond(text=reply.text, blocks=reason_blocks(reply.text, ref), response_type="ephemeral",
                          replace_original=False)
        else:
            await respond_private(respond, reply)

    @app.action(re.compile(f"^{REASON_ACTION}[0-9]+$"))
    async def reason_button(ack: Any, body: dict, respond: Any, action: dict) -> None:
        await ack()
        reply = await core.reason(
            (body.get("user") or {}).get("id"), (body.get("channel") or {}).get("id", ""),
            str(action.get("value") or ""), str(action.get("action_id", "")).removeprefix(REASON_ACTION),
        )
        if reply is not None:
            await respond(text=reply.text, response_type="ephemeral", replace_original=True)

    @app.action(STARS_ACTION)
    async def stars_select(ack: Any, body: dict, respond: Any, action: dict) -> None:
        stars = stars_of(str((action.get("selected_option") or {}).get("value") or ""))
        if stars is None:  # not one of the options we sent: a forged or garbled payload
            await ack()
            await respond(text="not a star rating (1-5)", response_type="ephemeral", replace_original=False)
            return
        await on_button(ack, body, respond, thumb_of(stars), stars)

    @app.action(GOOD_ACTION)
    async def good_button(ack: Any, body: dict, respond: Any) -> None:
        await on_button(ack, body, respond, 1)

    @app.action(BAD_ACTION)
    async def bad_button(ack: Any, body: dict, respond: Any) -> None:
        await on_button(ack, body, respond, -1)


def bolt_request(body: str, headers: dict[str, str | Sequence[str]], query: str = "") -> AsyncBoltRequest:
    """Bolt's request for a signed HTTP body. Bolt reads any form body holding the word "payload" as
    an interactive payload (`slack_bolt.request.internals.parse_body`), so `/rl bad the payload is
    wrong` would arrive empty and be refused: a form without a ``payload`` field is read as the form."""
    req = AsyncBoltRequest(body=body, query=query, headers=headers)
    if not req.body and "payload" in body and not body.lstrip().startswith("{"):
        form = dict(parse_qsl(body, keep_blank_values=True))
        if "payload" not in form:
            from slack_bolt.context.async_context import AsyncBoltContext
            from slack_bolt.request.async_internals import build_async_context

            req.body = form
            req.context = build_async_context(AsyncBoltContext({}), form)
    return req


def http_app(app: AsyncApp, path: str = "/slack/events") -> web.Application:
    """Bolt behind aiohttp, with a clear 400 for a body that is not JSON or a form (bolt would raise)."""
    from slack_bolt.adapter.aiohttp import to_aiohttp_response

    async def handle(request: web.Request) -> web.Response:
        body = await request.text()
        try:
            # a dict from the pairs: a repeated header ends as bolt's own loop over them leaves it (the last)
            req = bolt_request(body, dict(request.headers.items()), request.query_string)
        except (ValueError, TypeError, KeyError, AttributeError):  # bolt reads fields before it verifies
            return web.json_response({"error": "malformed payload"}, status=400)
        return await to_aiohttp_response(await app.async_dispatch(req))

    web_app = web.Application(client_max_size=MAX_BODY_BYTES)
    web_app.router.add_post(path, handle)
    return web_app


TOKEN_REFUSED = {"invalid_auth", "not_authed", "account_inactive", "token_revoked", "not_allowed_token_type"}
CONNECT_TIMEOUT_S = 30  # slack_sdk retries a websocket that will not open on its own, silently: cap it
WATCH_INTERVAL_S = 0.2


async def socket_mode(app: AsyncApp, app_token: str, link: Link) -> None:
    """One Socket Mode connection, until it closes. slack_sdk's own reconnecting is off: it retries
    where `rlfleet status` cannot see it, and redials a websocket URL that may have expired; the
    supervisor retries instead, with a fresh URL each time."""
    from slack_bolt.adapter.socket_mode.aiohttp import AsyncSocketModeHandler

    handler = AsyncSocketModeHandler(app, app_token)
    client = handler.client
    client.auto_reconnect_enabled = client.default_auto_reconnect_enabled = False
    try:
        try:
            client.wss_uri = (await client.web_client.apps_connections_open(app_token=app_token))["url"]
        except SlackApiError as exc:
            if (exc.response.get("error") if exc.response is not None else None) in TOKEN_REFUSED:
                raise ConfigError(f"Slack refused the app-level token ({exc.response['error']})") from None
            raise
        await asyncio.wait_for(client.connect(), CONNECT_TIMEOUT_S)
        if not await client.is_connected():
            raise ConnectionError("the Socket Mode websocket did not open")
        link.connected()
        while await client.is_connected():
            await asyncio.sleep(WATCH_INTERVAL_S)
    finally:
        await handler.close_async()


async def run(core: BotCore, cfg: Config, http: bool | None = None, host: str | None = None,
              port: int | None = None) -> None:
    """Serve until cancelled: Socket Mode, or HTTP on ``host:port`` at ``/slack/events``."""
    s = cfg.bots.slack
    http = s.http if http is None else http
    token = read_secret(s.token_env, s.token_file, "the Slack bot token")
    secret = read_secret(s.signing_secret_env, s.signing_secret_file, "the Slack signing secret") if http else None
    app_token = None if http else read_secret(s.app_token_env, s.app_token_file,
                                              "the Slack app-level token (Socket Mode)")
    link = Link("slack", core.handle.redis, (token, secret or "", app_token or ""))
    app = build_app(core, token, secret, s.api_base)

    @app.error
    async def on_error(error: Exception) -> None:  # a listener's call to Slack failed: its turn is over
        log.error("slack: a listener failed: %s", link.describe(error))
        link.noted(error)

    async def serve_http() -> None:
        async with listening(http_app(app), host or s.host, s.port if port is None else port) as bound:
            log.info("slack: HTTP on %s:%s/slack/events", host or s.host, bound)
            link.connected()
            await until_cancelled()

    async def attempt() -> None:
        if http:
            await serve_http()
        else:
            log.info("slack: Socket Mode")
            await socket_mode(app, app_token or "", link)

    await supervise(link, attempt, s)
