"""Microsoft Teams: botbuilder's CloudAdapter behind an aiohttp ``/api/messages`` endpoint.

Translation only. Teams has no slash commands: `/rl good` is message text (in channels after the
@mention, which is stripped). A user is their AAD object id (stable across chats); an answer is the
activity id `send_activity` returned, which a later reaction carries as ``replyToId``. Buttons are an
Adaptive Card whose ``Action.Submit`` comes back as a message with ``value`` {"rl": 1 | -1 | "stars"}
and the card's ★ menu ({"stars": "1".."5"}); a 👎 (button, stars under 4, or reaction) is answered
with a card of one-click reasons.
Bot Framework authentication is on whenever an app id is configured.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from aiohttp import web
from botbuilder.core import ActivityHandler, CardFactory, MessageFactory, TurnContext
from botbuilder.integration.aiohttp import CloudAdapter, ConfigurationBotFrameworkAuthentication
from botbuilder.schema import Activity, ChannelAccount, MessageReaction

from rlfleet.shared.config import Config, TeamsSettings
from rlfleet.shared.errors import ConfigError
from rlfleet.shared.ingress.grammar import is_rl, reaction_value, stars_of, thumb_of
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.secrets_file import read_secret
from rlfleet.shared.webserver import is_loopback, listening, until_cancelled

from .core import BotCore
from .supervisor import Link, supervise

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
REACTED_BAD = "noted your 👎"


STARS_INPUT = "stars"  # the card's 1-5 ★ menu; Teams merges its value into every Submit's data


def rating_card() -> Any:
    """👍 / 👎 and a 1-5 ★ menu with its own button. A thumb pressed with stars chosen sends both (the
    use case refuses a pair that disagrees, e.g. 👍 with 2★)."""
    return CardFactory.adaptive_card({
        "type": "AdaptiveCard", "version": "1.4",
        "body": [{"type": "Input.ChoiceSet", "id": STARS_INPUT, "style": "compact", "placeholder": "★ 1-5",
                  "choices": [{"title": "★" * n, "value": str(n)} for n in range(5, 0, -1)]}],
        "actions": [{"type": "Action.Submit", "title": "👍 good", "data": {"rl": 1}},
                    {"type": "Action.Submit", "title": "👎 bad", "data": {"rl": -1}},
                    {"type": "Action.Submit", "title": "★ rate", "data": {"rl": STARS_INPUT}}],
    })


def _pressed(value: dict) -> tuple[Literal[1, -1], int | None] | str:
    """A rating card's Submit as (thumb, stars), or why it is not one a card of ours sends."""
    chosen = value.get(STARS_INPUT)
    stars = stars_of(str(chosen)) if chosen not in (None, "") else None
    if chosen not in (None, "") and stars is None:
        return "not a star rating (1-5)"
    thumb = value.get("rl")
    if thumb == STARS_INPUT:
        return (thumb_of(stars), stars) if stars is not None else "choose 1-5 stars in the menu first"
    if type(thumb) is int and thumb in (1, -1):
        return (1 if thumb == 1 else -1), stars
    return "unknown button"


def reasons_card(text: str, answer_ref: str) -> Any:
    """A 👎's reply with the one-click reasons as buttons; each names the answer it is about (the card's
    own id is what a press of it replies to)."""
    return CardFactory.adaptive_card({
        "type": "AdaptiveCard", "version": "1.4",
        "body": [{"type": "TextBlock", "text": f"{text}\n\nWhy? (or type /rl why <words>)", "wrap": True}],
        "actions": [{"type": "Action.Submit", "title": reason, "data": {"rlwhy": i, "ref": answer_ref}}
                    for i, reason in enumerate(REASONS, 1)],
    })


def user_id(account: ChannelAccount | None) -> str | None:
    if account is None:
        return None
    return account.aad_object_id or account.id


def _is_bot(account: ChannelAccount | None) -> bool:
    return account is not None and (account.role or "").lower() == "bot"


class TeamsBot(ActivityHandler):
    def __init__(self, core: BotCore) -> None:
        self.core = core

    async def _say(self, turn: TurnContext, text: str) -> None:
        await turn.send_activity(MessageFactory.text(text))

    async def on_message_activity(self, turn: TurnContext) -> None:
        act = turn.activity
        actor, conversation = user_id(act.from_property), act.conversation.id if act.conversation else ""
        is_bot = _is_bot(act.from_property)
        if isinstance(act.value, dict) and "rl" in act.value:  # a rating card's button
            pressed = _pressed(act.value)
            if isinstance(pressed, str):
                await self._say(turn, pressed)
                return
            value, stars = pressed
            reply = await self.core.button(actor, conversation, act.reply_to_id or "", value, is_bot=is_bot,
                                           stars=stars)
            if reply is not None and reply.ask_why and act.reply_to_id:
                await turn.send_activity(MessageFactory.attachment(reasons_card(reply.text, act.reply_to_id)))
            elif reply is not None:
                await self._say(turn, reply.text)
            return
        if isinstance(act.value, dict) and "rlwhy" in act.value:  # a reasons card's button
            reply = await self.core.reason(actor, conversation, str(act.value.get("ref") or ""),
                                           str(act.value.get("rlwhy")), is_bot=is_bot)
            if reply is not None:
                await self._say(turn, reply.text)
            return
        text = (TurnContext.remove_recipient_mention(act) or "").strip()
        if not text or is_bot or not actor:
            return
        if is_rl(text, slash_optional=True):
            reply = await self.core.command(actor, conversation, text, target=act.reply_to_id)
            if reply is not None:
                await self._say(turn, reply.text)
            return
        is_dm = (act.conversation.conversation_type or "personal") == "personal" if act.conversation else True
        if not self.core.answers_in(conversation, is_dm) or self.core.seen(f"msg:{conversation}:{act.id}"):
            return

        async def post(answer: str) -> str | None:
            reply_activity = MessageFactory.text(answer)
            if self.core.settings.buttons:
                reply_activity.attachments = [rating_card()]
            sent = await turn.send_activity(reply_activity)
            return sent.id if sent is not None and sent.id else None

        async def fail(why: str) -> None:
            await self._say(turn, why)

        await self.core.answer_and_capture(actor, conversation, text, post, fail)

    async def _reactions(self, reactions: list[MessageReaction], turn: TurnContext, added: bool) -> None:
        act = turn.activity
        for r in reactions or ():
            if not isinstance(r, MessageReaction):  # a null in the list deserializes as None
                continue
            value = reaction_value(r.type)
            if value is None:
                continue
            counted = await self.core.reaction(
                user_id(act.from_property), act.conversation.id if act.conversation else "", act.reply_to_id or "",
                old=None if added else value, new=value if added else None, is_bot=_is_bot(act.from_property))
            if counted and added and value == -1 and act.reply_to_id and self.core.settings.buttons:
                # As after the 👎 button: the reasons, as a reply card (a reaction has no reply of its own).
                await turn.send_activity(MessageFactory.attachment(reasons_card(REACTED_BAD, act.reply_to_id)))

    async def on_reactions_added(self, message_reactions: list[MessageReaction], turn_context: TurnContext) -> None:
        await self._reactions(message_reactions, turn_context, added=True)

    async def on_reactions_removed(self, message_reactions: list[MessageReaction], turn_context: TurnContext) -> None:
        await self._reactions(message_reactions, turn_context, added=False)


class _AuthConfig:
    """The attribute bag ConfigurationBotFrameworkAuthentication reads."""

    def __init__(self, s: TeamsSettings, password: str | None) -> None:
        self.APP_ID = s.app_id or ""
        self.APP_PASSWORD = password or ""
        self.APP_TYPE = "SingleTenant" if s.tenant_id else "MultiTenant"
        self.APP_TENANTID = s.tenant_id or ""


MAX_ID_CHARS = 1024  # a connector's conversation and activity ids run to a couple of hundred


def _malformed(activity: Activity) -> str | None:
    """Why no Bot Framework connector would send this activity, or None. Without a recipient the
    handler's mention stripping raised, without a conversation the reply did; the reply names the
    conversation in its ``x-ms-conversation-id`` header, which takes only printable ASCII with no
    surrounding spaces, and both ids in its URL, which a server refuses past a few kB. Each of those
    turns failed after a 201, so the sender never learnt why."""
    if not isinstance(activity, Activity) or not activity.type:
        return "no type"
    conversation = activity.conversation.id if activity.conversation else None
    for name, value in (("serviceUrl", activity.service_url), ("from", activity.from_property),
                        ("recipient", activity.recipient), ("conversation.id", conversation)):
        if not value:
            return f"no {name}"
    if not (isinstance(conversation, str) and conversation.isascii() and conversation.isprintable()
            and conversation == conversation.strip()):
        return "conversation.id is not printable ASCII without surrounding spaces"
    for name, value in (("conversation.id", conversation), ("id", activity.id)):
        if isinstance(value, str) and len(value) > MAX_ID_CHARS:
            return f"{name} is over {MAX_ID_CHARS:,} characters"
    return None


class _KeysUnavailable(RuntimeError):
    pass


class _Authentication(ConfigurationBotFrameworkAuthentication):
    """botbuilder's token checks raise whatever PyJWT or a lookup raises on a token they cannot read
    (DecodeError for ``Bearer x``, KeyError for a token without ``iss``, IndexError for an unknown key
    id, InvalidSignatureError for a forged signature), and aiohttp answered those with 500. A token that
    cannot be verified is a refusal: PermissionError, which the adapter answers with 401. Failing to
    fetch the signing keys (requests' errors are OSErrors) is ours, not the sender's: 503."""

    async def authenticate_request(self, activity: Activity, auth_header: str) -> Any:
        try:
            return await super().authenticate_request(activity, auth_header)
        except PermissionError:
            raise
        except OSError as exc:
            raise _KeysUnavailable(exc.__class__.__name__) from None
        except Exception as exc:
            raise PermissionError(f"unverifiable credentials ({exc.__class__.__name__})") from None


def web_app(core: BotCore, settings: TeamsSettings, password: str | None,
            link: Link | None = None) -> web.Application:
    adapter = CloudAdapter(_Authentication(_AuthConfig(settings, password)))
    bot = TeamsBot(core)

    async def on_error(turn: TurnContext, error: Exception) -> None:
        """A turn that failed (most often a reply the connector refused or never took) ends here, and
        the endpoint goes on serving the next one."""
        log.error("teams turn failed: %s", error.__class__.__name__)
        if link is not None:
            link.noted(error)

    adapter.on_turn_error = on_error

    async def messages(request: web.Request) -> web.Response:
        if "application/json" not in request.headers.get("Content-Type", ""):
            return web.json_response({"error": "expected an application/json activity"}, status=415)
        try:
            activity = Activity().deserialize(await request.json())
        except ValueError:
            return web.json_response({"error": "malformed activity"}, status=400)
        why = _malformed(activity)
        if why:
            return web.json_response({"error": f"malformed activity: {why}"}, status=400)
        try:
            response = await adapter.process(request, bot)
        except PermissionError:
            return web.json_response({"error": "unauthorized"}, status=401)
        except _KeysUnavailable as exc:
            log.warning("teams: cannot verify a request: the Bot Framework signing keys are unreachable (%s)", exc)
            return web.json_response({"error": "cannot verify the sender now"}, status=503)
        return response or web.Response(status=201)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/api/messages", messages)
    return app


async def run(core: BotCore, cfg: Config, http: bool | None = None, host: str | None = None,
              port: int | None = None) -> None:
    """Serve ``/api/messages`` on ``host:port`` until cancelled (Teams only talks HTTP)."""
    s = cfg.bots.teams
    bind = (host or s.host, s.port if port is None else port)
    if not s.app_id and not is_loopback(bind[0]):
        # Without an app id no request is verified: whoever reaches the port speaks as any user, admins too.
        raise ConfigError(
            f"the Teams bot would listen on {bind[0]} with no app_id, so it could not tell who sends a message: "
            f"set bots.teams.app_id (and the app password in ${s.token_env} or a 0600 file), or listen on "
            "127.0.0.1 (the Bot Framework Emulator)")
    password = read_secret(s.token_env, s.token_file, "the Teams app password") if s.app_id else None
    link = Link("teams", core.handle.redis, (password or "",))

    async def attempt() -> None:
        async with listening(web_app(core, s, password, link), *bind) as bound:
            log.info("teams: /api/messages on %s:%s (auth %s)", bind[0], bound,
                     "on" if s.app_id else "off: no app_id")
            link.connected()
            await until_cancelled()

    await supervise(link, attempt, s)
