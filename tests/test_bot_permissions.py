"""The permission matrix, DESIGN.md §4: (capture owner, allowlisted rater, admin, stranger, bot) x
(good, bad, undo, status, train, rollback, reset, pause, resume, reaction add / change / remove), on each of the four
platforms' configurations, through the BotCore every adapter calls and the real worker."""

from __future__ import annotations

import pytest
from botrig import ADMIN, OWNER, RATER, STRANGER, LiveWorker, bot_rig, run

from rlfleet.bots.completions import Completion
from rlfleet.shared.models import model_slug

BOT_USER = "1999"
ROLES = {"owner": OWNER, "rater": RATER, "admin": ADMIN, "stranger": STRANGER, "bot": BOT_USER}
CONV, REF = "conv-1", "msg-1"

# role -> may rate (commands, reactions, buttons); may run admin commands. Bots may do nothing.
MAY_RATE = {"owner": True, "rater": True, "admin": True, "stranger": False, "bot": False}
MAY_ADMIN = {"owner": False, "rater": False, "admin": True, "stranger": False, "bot": False}


async def _scenario(platform: str, role: str) -> None:
    async with bot_rig(platform) as r:
        with LiveWorker(r.handle):
            await _matrix(r, platform, role)


async def _matrix(r, platform: str, role: str) -> None:
    actor, is_bot = ROLES[role], role == "bot"
    core = r.core
    core.capture(CONV, REF, OWNER, [{"role": "user", "content": "hi"}], Completion("hello there", "tiny"))
    await r.settle()

    async def say(text: str):
        reply = await core.command(actor, CONV, text, is_bot=is_bot)
        await r.settle()
        r.handle.redis.delete(f"rlfleet:cooldown:{platform}:{actor}")  # the cooldown has its own tests
        return reply

    mine = lambda: [(v, s) for a, v, s in r.ratings() if a == actor]  # noqa: E731

    # /rl good, /rl bad, /rl undo
    reply = await say("good")
    if is_bot:
        assert reply is None and r.ratings() == []
    elif MAY_RATE[role]:
        assert mine() == [(1, "active")], (role, reply)
    else:
        assert "nothing of yours to rate here" in reply.text and r.ratings() == []
    await say("bad")
    assert mine() == ([(1, "replaced"), (-1, "active")] if MAY_RATE[role] else [])
    reply = await say("undo")
    if MAY_RATE[role]:
        assert mine()[-1] == (-1, "undone")
    elif not is_bot:
        assert reply.text == "nothing of yours to undo" and r.ratings() == []

    # reactions: add, change (one update, as Telegram sends it), remove
    before = len(r.ratings())
    assert await core.reaction(actor, CONV, REF, None, 1, is_bot=is_bot) is MAY_RATE[role]
    await r.settle()
    assert await core.reaction(actor, CONV, REF, 1, -1, is_bot=is_bot) is MAY_RATE[role]
    await r.settle()
    assert await core.reaction(actor, CONV, REF, -1, None, is_bot=is_bot) is MAY_RATE[role]
    await r.settle()
    if MAY_RATE[role]:
        assert mine()[-2:] == [(1, "replaced"), (-1, "undone")]
    else:
        assert len(r.ratings()) == before and r.queued() == 0
    # a button press is a rating with a private reply
    reply = await core.button(actor, CONV, REF, 1, is_bot=is_bot)
    await r.settle()
    assert (reply is None) if is_bot else (reply.text.startswith("rated good") == MAY_RATE[role])

    # status for every person, admin commands for admins only
    reply = await say("status")
    assert (reply is None) if is_bot else reply.text.startswith("serving the base model")
    slug = model_slug(r.cfg.model)
    for cmd, done in (("train", "training run"), ("rollback", "already on the base model"),
                      ("reset", "reset to the base model"), ("pause", "automatic training paused"),
                      ("resume", "automatic training resumed")):
        reply = await say(cmd)
        if is_bot:
            assert reply is None
        elif MAY_ADMIN[role]:
            assert done in reply.text, (cmd, reply)
        else:
            assert reply.text == f"/rl {cmd} is for admins only"
        if cmd == "pause":
            assert r.store.training_paused(slug) is MAY_ADMIN[role]
    assert r.queued() == 0 and not r.store.training_paused(slug)


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("platform", ["slack", "discord", "telegram", "teams"])
def test_permission_matrix(queued_home, platform, role):
    run(_scenario(platform, role))


def test_allowlists_are_per_platform(queued_home):
    async def go():
        async with bot_rig("slack") as r:  # RATER is a Slack rater, not a Discord one
            r.core.capture(CONV, REF, OWNER, [{"role": "user", "content": "hi"}], Completion("hello", "tiny"))
            r.work()
            from rlfleet.bots.core import BotCore

            discord = BotCore("discord", r.cfg, r.handle, r.store, wait_s=0.2)
            assert await discord.reaction(RATER, CONV, REF, None, 1) is False  # a Slack answer is not Discord's
            assert await r.core.reaction(RATER, CONV, REF, None, 1) is True
    run(go())
