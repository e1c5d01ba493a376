"""Per-person and per-channel adapters (shared/scopes.py): which lineage a rating trains, and, through
the real queue, store and trainer on the tiny model, that two people with opposite tastes each get an
adapter moved their own way while neither moves the other's nor the shared one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rq import Queue, SimpleWorker
from typer.testing import CliRunner

from rlfleet.cli import dispatch
from rlfleet.cli.app import app
from rlfleet.shared import scopes
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Rating
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import TRAIN_QUEUE, open_queue
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.store import Store


def test_a_rating_trains_its_raters_or_its_channels_lineage_as_configured():
    assert scopes.scope_key("shared", "slack", "U1", "C1") == "shared"
    assert scopes.scope_key("person", "slack", "U1", "C1") == "person:slack:U1"
    assert scopes.scope_key("channel", "slack", "U1", "C1") == "channel:slack:C1"
    assert scopes.scope_key("channel", "cli", "local", None) == "person:cli:local"  # no conversation: the person's
    assert scopes.scope_key("person", "slack", None, "C1") == "shared"  # a sender the platform does not name
    assert scopes.lineage("m", "shared") == "m"  # the shared scope is the model's lineage as before scopes
    name = scopes.lineage("m", "person:slack:U1")
    assert name == "m@person:slack:U1" and scopes.split(name) == ("m", "person:slack:U1")
    assert scopes.split("m") == ("m", "shared") and not scopes.is_scoped("m") and scopes.is_scoped(name)
    long = scopes.lineage("m", "channel:teams:" + "19:" + "x" * 400)
    assert len(long) <= scopes.MAX_LINEAGE and long == scopes.lineage("m", "channel:teams:" + "19:" + "x" * 400)
    assert long != scopes.lineage("m", "channel:teams:" + "19:" + "x" * 399 + "y")  # cut, but told apart
    assert scopes.folder("m") == Path("m")
    odd = scopes.folder("m@person:slack:../../etc")
    assert odd.parts[0] == "m@scopes" and len(odd.parts) == 2  # one folder under the model's scopes, never above
    assert (Path("/root") / odd).resolve().is_relative_to("/root/m@scopes")
    with pytest.raises(ValueError):
        scopes.lineage("a@b", "person:cli:x")


def test_the_channels_scope_wins_over_the_platforms_which_wins_over_the_default(home):
    cfg = load_config()
    assert not cfg.scoped and cfg.scope_for("slack", "C1") == "shared"
    cfg.bots.slack.scope = "person"
    cfg.bots.slack.channel_scopes = {"C-support": "channel"}
    assert cfg.scoped
    assert cfg.scope_for("slack", "C1") == "person" and cfg.scope_for("slack", "C-support") == "channel"
    assert cfg.scope_for("discord", "C1") == "shared" and cfg.scope_for("cli", None) == "shared"
    assert cfg.lineage_of("m", "slack", "U1", "C-support") == "m@channel:slack:C-support"
    cfg.save()
    assert load_config().scope_for("slack", "C-support") == "channel"  # kept in config.toml


GOOD, BAD = "yes yes yes yes", "no no no no"
TOPICS = ["cats", "dogs", "rain", "tea", "maps", "jazz", "bread", "snow"]
HELD_OUT = ["clocks", "bees", "pears", "tides"]


def test_two_people_with_opposite_tastes_each_train_their_own_adapter(queued_home, tiny_model_dir, monkeypatch,
                                                                       single_thread, tiny_trainer, tmp_path):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    cfg.train.scope = "person"
    # the tiny model needs a large step to show a preference (tests/test_trainer.py's LEARN)
    cfg.train.threshold, cfg.train.lr, cfg.train.steps, cfg.train.seq_band = 16, 3e-3, 8, (0.5, 2.0)
    cfg.train.neg_fade, cfg.train.gate, cfg.train.explore, cfg.train.hindsight = 0.0, False, 0, 0.0
    cfg.save()
    slug = model_slug(cfg.model)
    handle = open_queue(cfg)
    try:
        said = {}
        for person, liked in (("alice", GOOD), ("bob", BAD)):
            for i, topic in enumerate(TOPICS):
                for answer in (GOOD, BAD):
                    cap = Capture(source="cli", owner=person, conversation=f"{person}-chat",
                                  prompt=[{"role": "user", "content": f"Tell me about {topic}."}],
                                  response=answer, model="external")
                    assert dispatch(handle, cfg, cap)["ok"]
                    r = dispatch(handle, cfg, Rating(source="cli", actor=person, target=cap.capture_id,
                                                     value=1 if answer == liked else -1))
                    assert r["ok"], r
                    said[(person, i, answer)] = r.get("training")
        # each person's 16th rating queues their own run; nobody's reaches the shared threshold
        assert said[("alice", 7, BAD)].startswith("training run") and said[("bob", 7, BAD)].startswith("training run")
        assert handle.train.count == 2
        SimpleWorker([Queue(TRAIN_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)
    finally:
        handle.close()

    store = Store(cfg.db_url)
    regs = {p: AdapterRegistry(cfg.adapters_root, scopes.lineage(slug, f"person:cli:{p}")) for p in ("alice", "bob")}
    assert all(r.current() == "v0001" for r in regs.values()), [r.dir for r in regs.values()]
    assert AdapterRegistry(cfg.adapters_root, slug).current() is None  # the shared adapter: untouched
    assert store.pending_count(slug) == 0 and store.counts(slug).total == 0
    for person, reg in regs.items():  # each run trained on its person's ratings alone
        ids = set(reg.meta("v0001")["rating_ids"])
        actors = {r.actor for r, _ in store.rated_pairs(reg.slug)}
        assert len(ids) == 16 and actors == {person} and store.pending_count(reg.slug) == 0

    def shift(adapter: Path) -> float:
        """How much ``adapter`` moved held-out "yes" over "no", per token, against the base."""
        pairs = [([{"role": "user", "content": f"Tell me about {t}."}], a) for t in HELD_OUT for a in (GOOD, BAD)]
        with_it, base = tiny_trainer.mean_logprobs(pairs, adapter), tiny_trainer.mean_logprobs(pairs, None)
        moved = [w - b for w, b in zip(with_it, base, strict=True)]
        return sum(moved[0::2]) / len(HELD_OUT) - sum(moved[1::2]) / len(HELD_OUT)

    alice, bob = shift(regs["alice"].path("v0001")), shift(regs["bob"].path("v0001"))
    assert alice > 0.2 and bob < -0.2, (alice, bob)

    monkeypatch.setenv("RLFLEET_HOME", str(queued_home))
    shown = json.loads(CliRunner().invoke(app, ["status", "--json"], catch_exceptions=False).output)
    assert shown["adapter"]["current"] is None and shown["ratings"]["total"] == 0
    assert set(shown["scopes"]) == {"person:cli:alice", "person:cli:bob"}
    for key, scope in shown["scopes"].items():
        assert scope["adapter"] == {"current": "v0001", "versions": 1}
        assert scope["ratings"] == {"total": 16, "good": 8, "bad": 8, "pending": 0}
        assert scope["training"]["state"] == "idle" and scope["lineage"].endswith("@" + key)

    cli = CliRunner()
    alone = json.loads(cli.invoke(app, ["status", "--json", "--scope", "person:cli:alice"]).output)
    assert alone["adapter"]["current"] == "v0001" and alone["ratings"]["total"] == 16 and alone["scopes"] == {}
    history = json.loads(cli.invoke(app, ["history", "--json", "--scope", "person:cli:bob"]).output)
    assert [v["version"] for v in history] == ["v0001"]
    out = tmp_path / "all.jsonl"
    assert cli.invoke(app, ["export", "ratings", str(out)]).exit_code == 0  # a backup holds every scope
    assert sorted({json.loads(line)["rlfleet"]["actor"] for line in out.read_text().splitlines()}) == ["alice", "bob"]
    assert len(out.read_text().splitlines()) == 32
    assert cli.invoke(app, ["export", "ratings", str(out), "--scope", "person:cli:bob", "--force"]).exit_code == 0
    assert {json.loads(line)["rlfleet"]["actor"] for line in out.read_text().splitlines()} == {"bob"}
    bad = cli.invoke(app, ["status", "--scope", "person:nowhere:x"])
    assert bad.exit_code != 0 and "is not a scope" in str(bad.exception)  # main() prints it as one line
    paused_before = store.training_paused(scopes.lineage(slug, "person:cli:alice"))
    for argv in (["status"], ["history"], ["pause"], ["resume"], ["rollback", "base"], ["train"],
                 ["reset", "--yes"], ["export", "ratings", str(tmp_path / "typo.jsonl")]):
        typo = cli.invoke(app, [*argv, "--scope", "person:cli:alcie"])  # well formed, but nobody's
        assert typo.exit_code != 0 and "no scope person:cli:alcie in this data dir (scopes here: " \
            "person:cli:alice, person:cli:bob)" in str(typo.exception), (argv, typo.output, typo.exception)
    assert not (tmp_path / "typo.jsonl").exists() and store.training_paused(
        scopes.lineage(slug, "person:cli:alcie")) is False and regs["alice"].current() == "v0001"
    assert store.training_paused(scopes.lineage(slug, "person:cli:alice")) == paused_before

    # forgetting alice deletes her ratings, the answers given to her and her adapter; bob keeps his
    assert "needs --yes" in str(cli.invoke(app, ["forget", "cli:alice"]).exception)  # not a terminal: no prompt
    assert "is not SOURCE:ID" in str(cli.invoke(app, ["forget", "alice", "--yes"]).exception)
    gone = json.loads(cli.invoke(app, ["forget", "cli:alice", "--yes", "--json"]).output)
    assert (gone["ratings"], gone["captures"], gone["adapter_versions"]) == (16, 16, ["v0001"])
    assert gone["trained_elsewhere"] == {} and "forgot cli:alice" in gone["message"]
    assert not regs["alice"].dir.exists() and regs["bob"].current() == "v0001"
    assert {r.actor for r, _ in store.rated_pairs(slug, all_states=True, with_scopes=True)} == {"bob"}
    left = json.loads(cli.invoke(app, ["status", "--json"]).output)
    assert set(left["scopes"]) == {"person:cli:bob"}
    again = json.loads(cli.invoke(app, ["forget", "cli:alice", "--yes", "--json"]).output)
    assert (again["ratings"], again["captures"], again["adapter_versions"]) == (0, 0, [])

    # the data dir's owner (an admin) acts on any scope's adapter from the command line
    back = json.loads(cli.invoke(app, ["rollback", "base", "--scope", "person:cli:bob", "--json"]).output)
    assert back["ok"] and regs["bob"].current() is None
    assert json.loads(cli.invoke(app, ["promote", "v0001", "--scope", "person:cli:bob", "--json"]).output)["ok"]
    assert regs["bob"].current() == "v0001" and AdapterRegistry(cfg.adapters_root, slug).current() is None


def test_a_busy_scope_never_queues_ahead_of_a_quiet_one_twice(queued_home, rconn):
    """The training queue takes scopes in turn: each lineage holds at most one queued or running run
    (its training lock), so a quiet scope whose ratings reach its threshold waits behind at most one run
    of each busy neighbour, however many ratings the neighbour adds meanwhile."""
    from rlfleet.shared.queue import train_lock_key
    from rlfleet.worker.context import context
    from rlfleet.worker.trigger import maybe_trigger

    cfg = load_config()
    cfg.train.scope, cfg.train.threshold = "channel", 2
    cfg.save()
    ctx = context()
    busy, quiet = (ctx.scoped(scopes.lineage(ctx.slug, f"channel:slack:{c}")) for c in ("C-busy", "C-quiet"))

    def rate(scoped, n: int) -> None:
        for _ in range(n):
            c = Capture(source="slack", owner="U1", conversation="x", prompt=[{"role": "user", "content": "q"}],
                        response="a", model="m")
            ctx.store.apply_many([c, Rating(source="slack", actor="U1", target=c.capture_id, value=1)], scoped.slug)

    queue = Queue(TRAIN_QUEUE, connection=rconn)
    rate(busy, 2)
    assert maybe_trigger(busy, rconn).startswith("training run")
    rate(quiet, 2)
    assert maybe_trigger(quiet, rconn).startswith("training run")
    for _ in range(3):  # the busy channel goes on rating: no second run of its own jumps the queue
        rate(busy, 2)
        assert "already" in maybe_trigger(busy, rconn)
    assert [j.args[1] for j in queue.jobs] == [busy.slug, quiet.slug]
    # the busy channel's run ends (its job taken, its lock let go): its next run queues behind the quiet one's
    queue.jobs[0].delete()
    rconn.delete(train_lock_key(busy.slug))
    ctx.store.fail_run(ctx.store.latest_run(busy.slug).id, "taken by the test", state="skipped")
    rate(busy, 2)
    assert maybe_trigger(busy, rconn, force=True).startswith("training run")
    assert [j.args[1] for j in queue.jobs] == [quiet.slug, busy.slug]


def test_a_scope_can_start_from_the_teams_adapter(queued_home, tiny_model_dir, monkeypatch, single_thread):
    """``train.scope_parent = "shared"``: before a person has a version, the team's adapter answers them,
    and their first run trains on top of a copy of it, which stays their rollback target."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlfleet.shared.responder import responder_for

    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    cfg.train.scope, cfg.train.scope_parent, cfg.train.threshold, cfg.train.steps = "person", "shared", 4, 2
    cfg.train.gate, cfg.train.explore, cfg.train.hindsight = False, 0, 0.0
    cfg.save()
    slug = model_slug(cfg.model)
    team = AdapterRegistry(cfg.adapters_root, slug)
    torch.manual_seed(3)
    lora = LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora).save_pretrained(team.path("v0001"))
    team.set_current("v0001")

    responder = responder_for(cfg)
    ask = [{"role": "user", "content": "hello"}]
    assert responder.answer(ask, seed=1, scope="person:cli:carol").adapter_version == "v0001"  # the team's
    responder.scope_fallback = False
    assert responder.answer(ask, seed=1, scope="person:cli:carol").adapter_version is None  # scope_parent base

    handle = open_queue(cfg)
    try:
        for i in range(4):
            cap = Capture(source="cli", owner="carol", conversation="c", model="external",
                          prompt=[{"role": "user", "content": f"q{i}"}], response=GOOD if i % 2 else BAD)
            assert dispatch(handle, cfg, cap)["ok"]
            assert dispatch(handle, cfg, Rating(source="cli", actor="carol", target=cap.capture_id,
                                                value=1 if i % 2 else -1))["ok"]
        SimpleWorker([Queue(TRAIN_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)
    finally:
        handle.close()
    carol = AdapterRegistry(cfg.adapters_root, scopes.lineage(slug, "person:cli:carol"))
    assert carol.versions() == ["v0001", "v0002"] and carol.current() == "v0002"
    assert carol.meta("v0001")["copied_from"] == f"{slug} v0001" and carol.meta("v0002")["parent"] == "v0001"
    assert (carol.path("v0001") / "adapter_model.safetensors").read_bytes() == \
        (team.path("v0001") / "adapter_model.safetensors").read_bytes()
    assert team.current() == "v0001" and team.versions() == ["v0001"]  # the team's adapter: untouched
