"""Telegram: python-telegram-bot's Application, long polling by default or a webhook (`--http`).

Translation only. A message is ``chat_id:message_id``; a conversation is the chat id. In groups the bot
answers when @mentioned or replied to, in private chats always. `/rl` is a ``CommandHandler``
(``/rl@thisbot`` in groups; ``/rl@otherbot`` is not ours). Reactions arrive only when the bot is an
admin of the group (Telegram's rule) and ``message_reaction`` is among the allowed updates.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Literal

from aiohttp import web
from telegram import InlineKeyboardButton, InlineKeyboardMarkup, Message, MessageEntity, ReactionTypeEmoji, Update
from telegram.constants import ChatType
from telegram.error import InvalidToken, TelegramError
from telegram.ext import (
    Application,
    CallbackQueryHandler,
    CommandHandler,
    ContextTypes,
    MessageHandler,
    MessageReactionHandler,
    filters,
)

from rlfleet.shared.config import Config
from rlfleet.shared.errors import ConfigError
from rlfleet.shared.ingress.grammar import reaction_value, stars_of, thumb_of
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.secrets_file import read_secret
from rlfleet.shared.webserver import listening, until_cancelled

from .core import BotCore
from .supervisor import Link, supervise

log = logging.getLogger(__name__)

ALLOWED_UPDATES = ["message", "callback_query", "message_reaction"]
MAX_BODY_BYTES = 1 << 20
_BUTTON = "rl:"  # callback data: "rl:1" / "rl:-1"
_REASON = "rlwhy:"  # + the reason's number in shared/ingress/reasons.REASONS
_STARS = "rlstars:"  # + 1..5


def message_ref(chat_id: int, message_id: int) -> str:
    return f"{chat_id}:{message_id}"


def rating_keyboard(reasons: bool = False) -> InlineKeyboardMarkup:
    """The good/bad row and a 1-5 ★ row under an answer; after a 👎, the one-click reasons under them too
    (each one about the message it sits on)."""
    rows = [[InlineKeyboardButton("👍 good", callback_data=f"{_BUTTON}1"),
             InlineKeyboardButton("👎 bad", callback_data=f"{_BUTTON}-1")],
            [InlineKeyboardButton(f"{n}★", callback_data=f"{_STARS}{n}") for n in range(1, 6)]]
    if reasons:
        why = [InlineKeyboardButton(r, callback_data=f"{_REASON}{i}") for i, r in enumerate(REASONS, 1)]
        rows += [why[:3], why[3:]]
    return InlineKeyboardMarkup(rows)


def pressed(data: str) -> tuple[Literal[1, -1], int | None] | None:
    """A rating button's callback data as (thumb, stars); None for data no keyboard of ours sends."""
    if data.startswith(_STARS):
        stars = stars_of(data.removeprefix(_STARS))
        return None if stars is None else (thumb_of(stars), stars)
    return {f"{_BUTTON}1": (1, None), f"{_BUTTON}-1": (-1, None)}.get(data)  # type: ignore[return-value]


def thumb(reactions: Any) -> Literal[1, -1] | None:
    """The thumbs value among a reaction list (the first thumb wins; other emoji do not count)."""
    for r in reactions or ():
        if isinstance(r, ReactionTypeEmoji):
            value = reaction_value(r.emoji)
            if value is not None:
                return value
    return None


def _addressed(msg: Message, bot_id: int, username: str) -> tuple[bool, str]:
    """Whether the bot is addressed, and the text without the @mention."""
    text = msg.text or ""
    if msg.chat.type == ChatType.PRIVATE:
        return True, text
    replied = msg.reply_to_message is not None and msg.reply_to_message.from_user is not None \
        and msg.reply_to_message.from_user.id == bot_id
    mention = f"@{username}".lower()
    mentioned = any(e.type == MessageEntity.MENTION and msg.parse_entity(e).lower() == mention
                    for e in msg.entities or ())
    if mentioned:
        text = " ".join(w for w in text.split() if w.lower() != mention)
    return replied or mentioned, text


def build_application(core: BotCore, token: str, api_base: str | None = None) -> Application:
    builder = Application.builder().token(token)
    if api_base:
        base = api_base.rstrip("/")
        builder = builder.base_url(f"{base}/bot").base_file_url(f"{base}/file/bot")
    application = builder.build()
    settings = core.settings

    async def rl(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        msg, user = update.effective_message, update.effective_user
        if msg is None or user is None:
            return
        text = (msg.text or "").partition(" ")[2]
        target = None
        if msg.reply_to_message is not None:
            target = message_ref(msg.chat_id, msg.reply_to_message.message_id)
        reply = await core.command(str(user.id), str(msg.chat_id), text, is_bot=user.is_bot, target=target)
        if reply is not None:
            await msg.reply_text(reply.text)

    async def on_text(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        msg, user = update.effective_message, update.effective_user
        if msg is None or user is None or user.is_bot or not msg.text:
            return
        addressed, text = _addressed(msg, context.bot.id, context.bot.username or "")
        is_dm = msg.chat.type == ChatType.PRIVATE
        if not addressed or not text.strip() or not core.answers_in(str(msg.chat_id), is_dm):
            return
        if core.seen(f"msg:{msg.chat_id}:{msg.message_id}"):
            return
        context_msgs: list[tuple[bool, str]] = []
        parent = msg.reply_to_message
        if parent is not None and parent.text and settings.context_messages:
            context_msgs.append((parent.from_user is not None and parent.from_user.id == context.bot.id, parent.text))

        async def post(answer: str) -> str:
            sent = await msg.reply_text(answer, reply_markup=rating_keyboard() if settings.buttons else None)
            return message_ref(sent.chat_id, sent.message_id)

        async def fail(why: str) -> None:
            await msg.reply_text(why)

        await core.answer_and_capture(str(user.id), str(msg.chat_id), text.strip(), post, fail, context_msgs)

    async def on_reaction(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        r = update.message_reaction
        if r is None:
            return
        user = r.user  # None for anonymous admins and channels: they cannot own an answer
        old, new = thumb(r.old_reaction), thumb(r.new_reaction)
        counted = await core.reaction(
            str(user.id) if user else None, str(r.chat.id), message_ref(r.chat.id, r.message_id),
            old=old, new=new, is_bot=bool(user and user.is_bot),
        )
        if counted and new == -1 and old != -1 and settings.buttons:
            # As after the 👎 button: the reasons under the answer until one is chosen.
            try:
                await context.bot.edit_message_reply_markup(chat_id=r.chat.id, message_id=r.message_id,
                                                            reply_markup=rating_keyboard(reasons=True))
            except TelegramError as exc:
                log.info("could not offer the reasons under an answer: %s", exc)

    async def on_button(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        q = update.callback_query
        if q is None or q.message is None or not q.data:
            return
        rating = pressed(q.data)
        if rating is None:
            await q.answer("unknown button")
            return
        msg = q.message
        reply = await core.button(str(q.from_user.id), str(msg.chat.id), message_ref(msg.chat.id, msg.message_id),
                                  rating[0], is_bot=q.from_user.is_bot, stars=rating[1])
        await q.answer(reply.text if reply else None)  # a toast only the presser sees
        if reply is not None and reply.ask_why:
            await _show(q, rating_keyboard(reasons=True))

    async def on_reason(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        q = update.callback_query
        if q is None or q.message is None or not q.data:
            return
        msg = q.message
        reply = await core.reason(str(q.from_user.id), str(msg.chat.id), message_ref(msg.chat.id, msg.message_id),
                                  q.data.removeprefix(_REASON), is_bot=q.from_user.is_bot)
        await q.answer(reply.text if reply else None)
        if reply is not None and reply.recorded:  # given: the reasons leave the answer
            await _show(q, rating_keyboard())

    application.add_handler(CommandHandler("rl", rl))
    application.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, on_text))
    application.add_handler(MessageReactionHandler(on_reaction))
    application.add_handler(CallbackQueryHandler(on_button, pattern=f"^({_BUTTON}|{_STARS})"))
    application.add_handler(CallbackQueryHandler(on_reason, pattern=f"^{_REASON}"))
    return application


async def _show(q: Any, keyboard: InlineKeyboardMarkup) -> None:
    """The answer's buttons as ``keyboard``; a message Telegram will not edit (too old, deleted) keeps
    the ones it has."""
    try:
        await q.edit_message_reply_markup(reply_markup=keyboard)
    except TelegramError as exc:
        log.info("could not change the buttons under an answer: %s", exc)


def webhook_app(application: Application, secret: str, path: str = "/telegram") -> web.Application:
    """The webhook endpoint: Telegram's secret-token header checked in constant time, a clear 400 for
    a body that is not an update, and the update handed to the application's queue."""

    async def handle(request: web.Request) -> web.Response:
        token = request.headers.get("X-Telegram-Bot-Api-Secret-Token", "")
        if not hmac.compare_digest(token.encode(), secret.encode()):
            return web.json_response({"error": "bad or missing secret token"}, status=403)
        try:
            update = Update.de_json(await request.json(), application.bot)
        except (ValueError, TypeError, KeyError, AttributeError):
            update = None
        if update is None:
            return web.json_response({"error": "malformed update"}, status=400)
        await application.update_queue.put(update)
        return web.json_response({"ok": True})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(path, handle)
    return app


async def run(core: BotCore, cfg: Config, http: bool | None = None, host: str | None = None,
              port: int | None = None) -> None:
    """Long polling, or a webhook at ``host:port/telegram`` (registered with Telegram at ``webhook_url``)."""
    s = cfg.bots.telegram
    http = s.http if http is None else http
    token = read_secret(s.token_env, s.token_file, "the Telegram bot token")
    secret = read_secret(s.webhook_secret_env, s.webhook_secret_file, "the Telegram webhook secret") if http else None
    if http and not s.webhook_url:
        raise ConfigError("telegram webhook mode needs bots.telegram.webhook_url (the public HTTPS URL)")
    link = Link("telegram", core.handle.redis, (token, secret or ""))
    application = build_application(core, token, s.api_base)
    updater = application.updater
    assert updater is not None  # the builder makes one unless told not to

    async def on_error(update: object, context: ContextTypes.DEFAULT_TYPE) -> None:
        log.error("telegram: a handler failed: %s", link.describe(context.error or "unknown error"))
        if context.error is not None:
            link.noted(context.error)

    application.add_error_handler(on_error)

    async def webhook() -> None:
        bind = (host or s.host, s.port if port is None else port)
        async with listening(webhook_app(application, secret or ""), *bind) as bound:
            await application.bot.set_webhook(url=s.webhook_url, secret_token=secret,
                                              allowed_updates=ALLOWED_UPDATES)
            log.info("telegram: webhook on %s:%s/telegram", bind[0], bound)
            link.connected()
            await until_cancelled()

    async def polling() -> None:
        """Until a getUpdates fails for a reason other than a timeout or a rate limit (those PTB waits
        out itself): the supervisor's backoff then applies, not PTB's quiet one. The same updater
        carries on, so its offset still confirms what was handled."""
        lost: asyncio.Future[TelegramError] = asyncio.get_running_loop().create_future()
        await application.bot.delete_webhook()  # polling and a webhook exclude each other

        def failed(e: TelegramError) -> None:
            if not lost.done():
                lost.set_result(e)

        await updater.start_polling(allowed_updates=ALLOWED_UPDATES, error_callback=failed)
        log.info("telegram: long polling")
        link.connected()
        raise await lost

    async def attempt() -> None:
        await application.initialize()  # getMe; nothing once it has succeeded
        await application.start()
        try:
            await (webhook() if secret is not None else polling())
        finally:
            if updater.running:
                await updater.stop()
            await application.stop()

    try:
        await supervise(link, attempt, s, fatal=(InvalidToken,))
    finally:
        await application.shutdown()
