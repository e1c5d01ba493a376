"""The permission table (rlfleet.shared.permissions) on its own, and the use cases that ask it once per
event: who may rate whose answers, who may run admin commands, from each source."""

from __future__ import annotations

import os

import pytest

from rlfleet.shared.config import BridgeKey, load_config
from rlfleet.shared.events import Command, Rating
from rlfleet.shared.ingress.usecases import Reply, Send, UseCases
from rlfleet.shared.permissions import ADMIN_ACTIONS, Actor, LiveTable, PermissionTable

OWNER, RATER, ADMIN, STRANGER = "U1", "U2", "U3", "U4"
PLATFORMS = ("slack", "discord", "telegram", "teams")


@pytest.fixture
def cfg(home):
    cfg = load_config()
    for p in PLATFORMS:
        cfg.bots.get(p).raters = [f"{p}-{RATER}"]
        cfg.bots.get(p).admins = [f"{p}-{ADMIN}"]
    cfg.bridge.keys = [BridgeKey(id="ops", secret_env="X", admin=True), BridgeKey(id="gateway", secret_env="Y")]
    return cfg


@pytest.mark.parametrize("platform", PLATFORMS)
def test_on_a_platform_owners_rate_their_own_raters_and_admins_anyones_admins_command(cfg, platform):
    table = PermissionTable.for_config(cfg)
    owner, rater, admin, stranger = (Actor(platform, f"{platform}-{u}") for u in (OWNER, RATER, ADMIN, STRANGER))
    for who in (owner, rater, admin, stranger):
        decision = table.decide(who, "rate")
        assert decision.allowed and decision.reaches(who.id)  # everyone may rate what they were answered
        assert decision.reaches(owner.id) is (who != stranger)
        assert decision.scope == ("any" if who in (rater, admin) else "own")
        for action in ("status", "help", "undo"):
            assert table.decide(who, action).allowed
        for action in ADMIN_ACTIONS:
            d = table.decide(who, action)
            assert d.allowed is (who == admin)
            assert d.refusal == (None if who == admin else "admins-only")


@pytest.mark.parametrize("action", ["help", "status", "rate", "undo", "train", "reset"])
def test_bots_and_unnamed_senders_count_for_nothing(cfg, action):
    table = PermissionTable.for_config(cfg)
    for who in (Actor("slack", "slack-" + ADMIN, is_bot=True), Actor("slack", None), Actor("slack", "")):
        d = table.decide(who, action)
        assert not d.allowed and d.refusal == "nobody" and not d.reaches(OWNER)


def test_allowlists_are_per_platform(cfg):
    table = PermissionTable.for_config(cfg)
    assert table.decide(Actor("slack", "slack-" + RATER), "rate").scope == "any"
    assert table.decide(Actor("discord", "slack-" + RATER), "rate").scope == "own"
    assert not table.decide(Actor("discord", "slack-" + ADMIN), "train").allowed


def test_the_local_user_is_the_admin_of_the_cli_and_rates_their_own(cfg):
    table = PermissionTable.for_config(cfg)
    for action in ADMIN_ACTIONS:
        assert table.decide(Actor("cli", "local"), action).allowed
        assert not table.decide(Actor("cli", "someone"), action).allowed
    assert table.decide(Actor("cli", "local"), "rate").scope == "own"


@pytest.mark.parametrize("source", ["bridge", "claude-code", "codex"])
def test_a_bridge_key_acts_as_itself_admin_keys_command_and_nobody_widens_a_rating(cfg, source):
    table = PermissionTable.for_config(cfg)
    for key, admin in (("local", True), ("ops", True), ("gateway", False), ("mallory", False)):
        assert table.decide(Actor(source, key), "reset").allowed is admin
        # a data event names whoever the key vouches for: no name makes its rating reach others' answers
        assert table.decide(Actor(source, key), "rate").scope == "own"
    assert not table.decide(Actor("slack", "ops"), "reset").allowed  # a key's rights are the bridge's only


def test_the_bridges_own_keys_decide_who_is_an_admin(cfg):
    table = PermissionTable.for_config(cfg, admin_keys=["gateway"])
    assert table.decide(Actor("bridge", "gateway"), "train").allowed
    assert not table.decide(Actor("bridge", "ops"), "train").allowed
    assert table.decide(Actor("bridge", "local"), "train").allowed  # the data dir's own key, always


def test_the_live_table_follows_config_toml(cfg):
    cfg.save()
    live = LiveTable(cfg)
    newcomer = Actor("telegram", "4242")
    assert not live().decide(newcomer, "train").allowed
    cfg.bots.telegram.admins = ["4242"]
    cfg.save()
    os.utime(cfg.config_path, ns=(0, 1))  # a new mtime, however fast the two saves came
    assert live().decide(newcomer, "train").allowed
    cfg.config_path.write_text("not = [valid", encoding="utf-8")
    os.utime(cfg.config_path, ns=(0, 2))
    assert live().decide(newcomer, "train").allowed  # a config.toml being edited keeps the last table


# ---- the use cases ask the table once per event and carry its answer ------------------------------


def test_a_rating_carries_its_scope_and_an_admin_command_its_actor(cfg):
    cases = UseCases(PermissionTable.for_config(cfg), cfg.model)
    rater, owner = Actor("teams", "teams-" + RATER), Actor("teams", "teams-" + OWNER)
    for who, scope in ((rater, "any"), (owner, "own")):
        out = cases.rate(who, "conv", 1, "nice")
        assert isinstance(out, Send) and isinstance(out.event, Rating)
        assert (out.event.actor, out.event.target, out.event.scope, out.event.comment) == (who.id, "last", scope,
                                                                                            "nice")
    assert cases.command(owner, "reset") == Reply("/rl reset is for admins only")
    assert cases.command(Actor("teams", "teams-U3", is_bot=True), "reset") is None
    sent = cases.command(Actor("bridge", "ops"), "rollback", {"version": "v0001"}, event_id="e-1")
    assert isinstance(sent, Send) and sent.event == Command(source="bridge", actor="ops", name="rollback",
                                                            args={"version": "v0001"}, event_id="e-1",
                                                            ts=sent.event.ts)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_pause_and_resume_are_a_platforms_admins_only(cfg, platform):
    cases = UseCases(PermissionTable.for_config(cfg), cfg.model)
    for verb in ("pause", "resume"):
        for user in (OWNER, RATER, STRANGER):
            assert cases.rl(Actor(platform, f"{platform}-{user}"), "c", f"/rl {verb}") == \
                Reply(f"/rl {verb} is for admins only")
        assert cases.rl(Actor(platform, f"{platform}-{ADMIN}", is_bot=True), "c", f"/rl {verb}") is None
        out = cases.rl(Actor(platform, f"{platform}-{ADMIN}"), "c", f"/rl {verb} please")
        assert isinstance(out, Send) and (out.event.name, out.event.args, out.event.actor) == (
            verb, {}, f"{platform}-{ADMIN}")


def test_rl_text_goes_through_the_same_decisions(cfg):
    cases = UseCases(PermissionTable.for_config(cfg), cfg.model)
    stranger = Actor("slack", "slack-" + STRANGER)
    assert cases.rl(stranger, "c", "/rl train") == Reply("/rl train is for admins only")
    assert cases.rl(Actor("slack", None), "c", "/rl help") is None
    assert cases.rl(stranger, "c", "/rl dance").text.startswith("unknown command 'dance'. /rl good")
    out = cases.rl(Actor("slack", "slack-" + ADMIN), "c", "/rl rollback v0003")
    assert isinstance(out, Send) and out.event.args == {"version": "v0003"}
    undo = cases.rl(stranger, "c", "/rl undo")
    assert isinstance(undo, Send) and undo.event.actor == stranger.id  # it can only take back their own
