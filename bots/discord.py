"""Discord: discord.py over the gateway, non-privileged intents only.

Translation only. `/rl` is an app command on the command tree (synced with Discord on start), with the
action as a choice and an optional detail (the comment, or the version to roll back to); its replies
are ephemeral. The bot answers DMs, mentions and replies to its own answers: without the privileged
message-content intent Discord still sends the text of exactly those. 👍/👎 on an answer rate it;
buttons under each answer are a persistent view, so they keep working after a restart.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any, Literal

import discord
import yarl
from discord import app_commands

from rlfleet.shared.config import Config, DiscordSettings
from rlfleet.shared.ingress.grammar import Verb, reaction_value, stars_of, thumb_of
from rlfleet.shared.ingress.reasons import REASONS
from rlfleet.shared.secrets_file import read_secret

from .core import BotCore, Reply
from .supervisor import Link, supervise

log = logging.getLogger(__name__)

Action = Verb  # the /rl command's choices: every verb of the one grammar
_MENTION = re.compile(r"<@!?\d+>\s*")


def intents() -> discord.Intents:
    i = discord.Intents.none()
    i.guilds = i.guild_messages = i.dm_messages = True
    i.guild_reactions = i.dm_reactions = True
    return i


def _tolerant(parsers: dict[str, Callable[[Any], None]]) -> None:
    """discord.py parses each gateway event inside its receive loop, and `Client.connect` survives only
    connection errors: one event it cannot read (a reaction without ``emoji``, a list where an object
    belongs) ended the loop, `client.start()` raised and the bot stopped for good. Such an event is
    dropped with a warning instead; the connection and every other event carry on."""
    for name, parse in list(parsers.items()):
        def guarded(data: Any, _name: str = name, _parse: Callable[[Any], None] = parse) -> None:
            try:
                _readable(_name, data)
                _parse(data)
            except Exception as exc:
                log.warning("dropped a %s gateway event discord.py could not read (%s)", _name,
                            exc.__class__.__name__)
        parsers[name] = guarded


def _readable(name: str, data: Any) -> None:
    """What discord.py parses without complaint but cannot use later: an interaction whose token is not
    a string failed only when the handler answered it (inside discord.py's request, a crash in the
    handler's log)."""
    if name == "INTERACTION_CREATE" and not (isinstance(data, dict) and isinstance(data.get("token"), str)):
        raise TypeError("interaction token is not a string")


def _sender(interaction: discord.Interaction) -> tuple[str | None, bool]:
    """Who typed or pressed, and whether it is a bot. An interaction with neither ``member`` nor ``user``
    leaves discord.py's ``interaction.user`` a falsy MISSING: ``.id`` raised, and the person who saw
    "thinking…" never got a reply. Without a sender the core ignores it."""
    user = interaction.user
    return (str(user.id), bool(user.bot)) if user else (None, False)


_REASON = "rlwhy:"  # custom id of a one-click reason: rlwhy:<its number in REASONS>:<the answer's message id>


def reason_view(message_id: str) -> discord.ui.View:
    """The one-click reasons, under a 👎's private reply; each names the answer it is about, so a click is
    handled wherever it lands (RlfleetClient.on_interaction), not by this view's own callbacks."""
    return with_reasons(discord.ui.View(timeout=600), message_id)


def with_reasons(view: discord.ui.View, message_id: str) -> discord.ui.View:
    """``view`` with the one-click reasons as a row of its own, about the answer ``message_id``."""
    for i, reason in enumerate(REASONS, 1):
        view.add_item(discord.ui.Button(label=reason, custom_id=f"{_REASON}{i}:{message_id}"[:100],
                                        style=discord.ButtonStyle.secondary, row=2))
    return view


class RatingView(discord.ui.View):
    """👍 / 👎 and a 1-5 ★ menu under an answer; persistent (fixed custom ids, no timeout)."""

    def __init__(self, core: BotCore) -> None:
        super().__init__(timeout=None)
        self.core = core

    async def _rate(self, interaction: discord.Interaction, value: Literal[1, -1], stars: int | None = None) -> None:
        await interaction.response.defer(ephemeral=True, thinking=True)
        message = interaction.message
        actor, is_bot = _sender(interaction)
        reply = await self.core.button(
            actor, str(interaction.channel_id), str(message.id) if message else "", value, is_bot=is_bot,
            stars=stars,
        )
        if reply is not None and reply.ask_why and message is not None:
            await interaction.followup.send(reply.text, ephemeral=True, view=reason_view(str(message.id)))
        else:
            await interaction.followup.send((reply or Reply("ignored")).text, ephemeral=True)

    @discord.ui.button(label="good", emoji="👍", style=discord.ButtonStyle.secondary, custom_id="rl:1")
    async def good(self, interaction: discord.Interaction, button: discord.ui.Button) -> None:
        await self._rate(interaction, 1)

    @discord.ui.button(label="bad", emoji="👎", style=discord.ButtonStyle.secondary, custom_id="rl:-1")
    async def bad(self, interaction: discord.Interaction, button: discord.ui.Button) -> None:
        await self._rate(interaction, -1)

    @discord.ui.select(custom_id="rl:stars", placeholder="★ 1-5", row=1, options=[
        discord.SelectOption(label="★" * n, value=str(n)) for n in range(5, 0, -1)])
    async def stars(self, interaction: discord.Interaction, select: discord.ui.Select) -> None:
        stars = stars_of(select.values[0]) if select.values else None
        if stars is None:  # not one of the options we sent: a forged or garbled interaction
            await interaction.response.defer(ephemeral=True, thinking=True)
            await interaction.followup.send("not a star rating (1-5)", ephemeral=True)
            return
        await self._rate(interaction, thumb_of(stars), stars)


class RlfleetClient(discord.Client):
    def __init__(self, core: BotCore, sync_commands: bool = True, link: Link | None = None,
                 **options: object) -> None:
        super().__init__(intents=intents(), **options)  # type: ignore[arg-type]
        _tolerant(self._connection.parsers)
        self.core = core
        self.link = link
        self.sync_commands = sync_commands
        self.tree = app_commands.CommandTree(self)
        self.view = RatingView(core) if core.settings.buttons else None
        self._add_rl_command()

    def _add_rl_command(self) -> None:
        core = self.core

        @self.tree.command(name="rl", description="Rate the bot's answers, see status, or train (admins)")
        @app_commands.describe(action="what to do",
                               detail="a comment on good/bad, the reason of why, or the version to roll back to")
        async def rl(interaction: discord.Interaction, action: Action, detail: str | None = None) -> None:
            await interaction.response.defer(ephemeral=True, thinking=True)
            text = f"{action} {detail or ''}".strip()
            actor, is_bot = _sender(interaction)
            reply = await core.command(actor, str(interaction.channel_id), text, is_bot=is_bot)
            await interaction.followup.send((reply or Reply("ignored")).text, ephemeral=True)

    async def setup_hook(self) -> None:
        if self.view is not None:
            self.add_view(self.view)
        if self.sync_commands:
            await self.tree.sync()

    async def on_interaction(self, interaction: discord.Interaction) -> None:
        """A one-click reason pressed (every other interaction is the command tree's or a view's)."""
        data: dict[str, Any] = dict(interaction.data) if isinstance(interaction.data, dict) else {}
        custom_id = data.get("custom_id")
        if interaction.type != discord.InteractionType.component or not isinstance(custom_id, str) \
                or not custom_id.startswith(_REASON):
            return
        choice, _, ref = custom_id.removeprefix(_REASON).partition(":")
        await interaction.response.defer(ephemeral=True, thinking=True)
        actor, is_bot = _sender(interaction)
        reply = await self.core.reason(actor, str(interaction.channel_id), ref, choice, is_bot=is_bot)
        await interaction.followup.send((reply or Reply("ignored")).text, ephemeral=True)
        message = interaction.message
        if reply is not None and reply.recorded and self.view is not None and message is not None \
                and str(message.id) == ref:  # given under the answer itself: the reasons leave it
            await self._show(message, self.view)

    async def _show(self, message: discord.Message | discord.PartialMessage, view: discord.ui.View) -> None:
        """The answer's components as ``view``; one Discord will not edit (deleted, not the bot's) keeps
        the ones it has."""
        try:
            await message.edit(view=view)
        except discord.HTTPException as exc:
            log.info("could not change the buttons under an answer: %s", exc.__class__.__name__)

    async def on_ready(self) -> None:
        if self.link is not None:
            self.link.connected()

    async def on_resumed(self) -> None:
        await self.on_ready()

    async def on_disconnect(self) -> None:  # discord.py resumes by itself after most closes
        if self.link is not None and not self.is_closed():
            self.link.failed("the gateway connection closed")

    # ---- answering ------------------------------------------------------------------------------------

    async def on_message(self, message: discord.Message) -> None:
        me = self.user
        if me is None or message.author.bot or not message.content:
            return
        is_dm = message.guild is None
        ref = message.reference.resolved if message.reference else None
        replied = isinstance(ref, discord.Message) and ref.author.id == me.id
        addressed = is_dm or me in message.mentions or replied
        if not addressed or not self.core.answers_in(str(message.channel.id), is_dm):
            return
        if self.core.seen(f"msg:{message.id}"):
            return
        text = _MENTION.sub("", message.content).strip()
        if not text:
            return
        context = [(True, ref.content)] if replied and isinstance(ref, discord.Message) and ref.content else []

        async def post(answer: str) -> str:
            # discord.py's overloads leave out view=None, which it takes as no view
            sent = await message.reply(answer[:2000], view=self.view)  # type: ignore[arg-type, unused-ignore]
            return str(sent.id)

        async def fail(why: str) -> None:
            await message.reply(why)

        await self.core.answer_and_capture(str(message.author.id), str(message.channel.id), text, post, fail,
                                           context)

    # ---- reactions --------------------------------------------------------------------------------------

    async def _reaction(self, payload: discord.RawReactionActionEvent, added: bool) -> None:
        value = reaction_value(payload.emoji.name)
        if value is None or (self.user is not None and payload.user_id == self.user.id):
            return
        is_bot = bool(payload.member and payload.member.bot)
        counted = await self.core.reaction(str(payload.user_id), str(payload.channel_id), str(payload.message_id),
                                           old=None if added else value, new=value if added else None,
                                           is_bot=is_bot)
        if counted and added and value == -1 and self.view is not None:
            # As after the 👎 button: the reasons, here under the answer until one is chosen (a reaction
            # has no interaction to answer privately).
            answer = self.get_partial_messageable(payload.channel_id).get_partial_message(payload.message_id)
            await self._show(answer, with_reasons(RatingView(self.core), str(payload.message_id)))

    async def on_raw_reaction_add(self, payload: discord.RawReactionActionEvent) -> None:
        await self._reaction(payload, added=True)

    async def on_raw_reaction_remove(self, payload: discord.RawReactionActionEvent) -> None:
        await self._reaction(payload, added=False)


async def follow_gateway(client: discord.Client, settings: DiscordSettings) -> None:
    """Point the gateway where the configured API is. discord.py never asks the REST API for it: it
    dials its class-wide DEFAULT_GATEWAY (Discord's public one), also after an invalidated session. So
    with ``api_base`` set, the URL comes from that API's ``GET /gateway/bot``, unless ``gateway_url``
    names one."""
    url = settings.gateway_url
    if url is None and settings.api_base:
        _, url, _ = await client.http.get_bot_gateway()
    if url:
        discord.gateway.DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(url)


async def run(core: BotCore, cfg: Config, http: bool | None = None, host: str | None = None,
              port: int | None = None) -> None:
    """Stay connected to the gateway until cancelled (Discord has no HTTP mode in discord.py).

    Each attempt is a fresh client with discord.py's own reconnect off: when the first connection
    fails, that reconnect reads the session of the websocket it never opened and ends the client with
    an AttributeError. The supervisor retries instead, and a new IDENTIFY starts a new session; closes
    that allow it are still resumed by discord.py within an attempt."""
    s = cfg.bots.discord
    token = read_secret(s.token_env, s.token_file, "the Discord bot token")
    if s.api_base:
        discord.http.Route.BASE = s.api_base.rstrip("/")
    link = Link("discord", core.handle.redis, (token,))

    async def attempt() -> None:
        client = RlfleetClient(core, sync_commands=s.sync_commands, link=link)
        async with client:
            await client.login(token)
            await follow_gateway(client, s)
            await client.connect(reconnect=False)

    await supervise(link, attempt, s, fatal=(discord.LoginFailure, discord.PrivilegedIntentsRequired))
