"""The evaluation gate on real runs of the tiny model: a good candidate is promoted, one trained
against the user's current taste is rejected and kept out of service, `promote --force` overrides."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
from test_spine import _work_train_queue, opened_queue, rl, status
from test_trainer import BAD, GOOD, LEARN, TEMPLATES, chat

from rlfleet.cli import dispatch
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Rating
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.worker.gate import GateConfig
from rlfleet.worker.orchestrate import GateReferences, evaluate_candidate, fall_back
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training.scoring import score_model
from rlfleet.worker.training.torch_backend import Trainer

TOPICS = ["cats", "dogs", "rain", "tea", "maps", "jazz", "bread", "snow", "chess", "kites", "ships", "moss"]
HELD = ["clocks", "bees", "pears", "tides"]


def pairs(topics, flip=False):
    out = []
    for i, topic in enumerate(topics):
        p = chat(TEMPLATES[i % len(TEMPLATES)].format(topic))
        sign = -1.0 if flip else 1.0
        out += [TrainSample(2 * i, p, GOOD, sign), TrainSample(2 * i + 1, p, BAD, -sign)]
    return out


@pytest.fixture(scope="module")
def trainer(tiny_trainer) -> Trainer:
    return tiny_trainer


@pytest.mark.parametrize("flip, promoted", [(False, True), (True, False)])
def test_gate_promotes_a_good_candidate_and_rejects_one_trained_on_inverted_labels(
    trainer, tmp_path, flip, promoted
):
    out = tmp_path / "cand"
    run = trainer.run(pairs(TOPICS, flip), None, LEARN, None, out)
    assert run.promoted_ok  # the run's own checks pass either way: only the gate tells them apart
    verdict = evaluate_candidate(trainer, pairs(HELD), None, out, GateConfig(), 1024)
    m = verdict.metrics
    assert verdict.promote is promoted, verdict
    assert m["heldout_n"] == 8 and m["heldout_kl"] > 0 and m["entropy_ratio"] > 0
    if promoted:
        assert m["heldout_margin_after"] > m["heldout_margin_before"] + 0.3
    else:
        assert m["heldout_margin_after"] < m["heldout_margin_before"] - 0.3
        assert "margin fell" in verdict.reason


def test_gate_compares_with_the_parent_not_the_base(trainer, tmp_path):
    parent = tmp_path / "parent"
    trainer.run(pairs(TOPICS), None, LEARN, None, parent)
    # A continuation that learned nothing new is no worse than its parent, though far from the base.
    same = tmp_path / "same"
    trainer.run(pairs(TOPICS[:2]), None, replace(LEARN, lr=1e-9, steps=1), parent, same)
    v = evaluate_candidate(trainer, pairs(HELD), parent, same, GateConfig(), 1024)
    assert v.promote, v
    assert v.metrics["heldout_margin_before"] == pytest.approx(v.metrics["heldout_margin_after"], abs=1e-3)
    assert v.metrics["heldout_margin_before"] > 0.3  # the parent's margin, not the base's ~0


def test_the_parent_is_measured_for_its_margin_alone_without_a_pass_of_the_base(trainer, tmp_path, monkeypatch):
    parent = tmp_path / "parent"
    trainer.run(pairs(TOPICS), None, LEARN, None, parent)
    held = pairs(HELD)
    with_kl = score_model(trainer, [(s.prompt, s.response) for s in held], parent, GateConfig(eval_samples=0), 1024)
    assert with_kl.kl > 0
    passes: list[bool] = []  # per score_rows call: did it run the base beside the adapter?
    real = trainer.score_rows
    monkeypatch.setattr(trainer, "score_rows", lambda batch, with_kl: passes.append(with_kl) or real(batch, with_kl))
    refs = GateReferences.measure(trainer, held, parent, GateConfig(eval_samples=0), 1024)
    assert passes and not any(passes)  # the parent's scores alone, without a KL pass
    assert refs.parent.logprobs == pytest.approx(with_kl.logprobs, abs=1e-6)  # the margin reads these alone
    assert refs.parent.kl == 0.0


def test_the_base_is_measured_from_the_candidates_kl_pass_without_a_pass_of_its_own(trainer, tmp_path,
                                                                                    monkeypatch):
    """A first run's gate judges the candidate against the base: the base's log-probs and entropy are
    read from the pass of the base the candidate's exact KL runs anyway, and they are what a pass of
    the base alone measures (the margin before, the entropy ratio)."""
    from rlfleet.worker.gate import margin

    cand = tmp_path / "cand"
    trainer.run(pairs(TOPICS), None, LEARN, None, cand)
    held = pairs(HELD)
    gcfg = GateConfig(eval_samples=2, eval_new_tokens=6)
    plain = [(s.prompt, s.response) for s in held]
    base_alone = score_model(trainer, plain, None, gcfg, 1024)
    cand_alone = score_model(trainer, plain, cand, gcfg, 1024)
    passes: list[bool] = []
    real = trainer.score_rows
    monkeypatch.setattr(trainer, "score_rows", lambda batch, with_kl: passes.append(with_kl) or real(batch, with_kl))
    refs = GateReferences.measure(trainer, held, None, gcfg, 1024)
    assert passes == [] and refs.parent is None  # nothing scored before there is a candidate
    verdict = refs.judge(trainer, cand)
    assert passes and all(passes)  # the candidate's KL passes alone
    m = verdict.metrics
    assert m["heldout_margin_before"] == pytest.approx(margin(base_alone.logprobs, [s.reward for s in held]), abs=1e-5)
    assert m["heldout_margin_after"] == pytest.approx(margin(cand_alone.logprobs, [s.reward for s in held]), abs=1e-5)
    assert m["entropy_ratio"] == pytest.approx(cand_alone.entropy / base_alone.entropy, rel=1e-5)
    assert m["heldout_kl"] == pytest.approx(cand_alone.kl, rel=1e-5) and cand_alone.kl > 0
    assert refs.base_sampled and len(refs.base_sampled) == 2  # the base's own answers, drawn once


def test_a_refused_run_falls_back_to_its_halfway_step_when_that_passes(trainer, tmp_path):
    # The KL cap is set between what the halfway adapter and the full run measure on the held-out
    # answers, so the gate refuses the full run for its KL and only the smaller step can pass.
    full, halfway = tmp_path / "staging", tmp_path / "halfway"
    trainer.run(pairs(TOPICS), None, LEARN, None, full, halfway_dir=halfway)
    refs = GateReferences.measure(trainer, pairs(HELD), None, GateConfig(), 1024)
    kl = {name: refs.judge(trainer, d).metrics["heldout_kl"] for name, d in (("full", full), ("half", halfway))}
    assert 0 < kl["half"] < kl["full"], kl
    halfway_bytes = {f.name: f.read_bytes() for f in halfway.iterdir()}

    capped = replace(refs, gcfg=GateConfig(max_kl=(kl["half"] + kl["full"]) / 2))
    refused = capped.judge(trainer, full)
    assert not refused.promote and "KL to the base" in refused.reason
    v = fall_back(capped, trainer, refused, full, halfway, 4)
    assert v.promote, v
    assert v.metrics["fallback"] == "halfway" and v.metrics["steps_served"] == 4
    assert v.metrics["refused_full"] == refused.reason and v.metrics["heldout_kl"] == pytest.approx(kl["half"])
    # The version to commit is now the halfway adapter, byte for byte.
    assert {f.name: f.read_bytes() for f in full.iterdir()} == halfway_bytes

    # A cap below both: refused, and the reason says the smaller step was tried too.
    shutil.rmtree(full)
    shutil.rmtree(halfway)
    trainer.run(pairs(TOPICS), None, LEARN, None, full, halfway_dir=halfway)
    low = replace(refs, gcfg=GateConfig(max_kl=kl["half"] / 2))
    refused = low.judge(trainer, full)
    v = fall_back(low, trainer, refused, full, halfway, 4)
    assert not v.promote and v.metrics["fallback"] == "refused"
    assert v.reason.startswith(refused.reason) and "halfway through the run (step 4) too: KL to the base" in v.reason


# ---- through the queue, the worker and the CLI ----------------------------------------------------


@pytest.fixture
def gated_home(queued_home, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("RLFLEET_THRESHOLD", "12")
    cfg = load_config()
    cfg.train.lr, cfg.train.steps, cfg.train.seq_band = LEARN.lr, LEARN.steps, LEARN.seq_band
    cfg.train.max_tokens = 96
    cfg.save()
    return queued_home


def _rate(cfg, handle, topic: str, answer: str, value: int) -> dict:
    cap = Capture(prompt=chat(f"Tell me about {topic}."), response=answer, model="external", conversation="g")
    assert dispatch(handle, cfg, cap)["ok"]
    return dispatch(handle, cfg, Rating(value=value, target=cap.capture_id))


def _prefer(cfg, handle, topics, liked: str, disliked: str) -> None:
    """For each topic, rate ``liked`` good and ``disliked`` bad."""
    for t in topics:
        _rate(cfg, handle, t, liked, 1)
        _rate(cfg, handle, t, disliked, -1)


def test_a_run_against_current_taste_is_rejected_and_only_forced_into_service(gated_home):
    with opened_queue() as (cfg, handle):
        # The user first liked "no" answers, then changed their mind: the newest ratings (held out)
        # say "yes" is good, so a candidate trained on the older ones does worse on them.
        _prefer(cfg, handle, TOPICS[:4], BAD, GOOD)
        _prefer(cfg, handle, HELD[:2], GOOD, BAD)
        _work_train_queue(handle)
        st = status()
        (v,) = st["adapter"]["versions"]
        assert v["status"] == "rejected" and st["adapter"]["current"] is None
        assert v["metrics"]["verdict"] == "rejected" and v["metrics"]["heldout_n"] == 4
        assert st["training"]["state"] == "failed" and "v0001 was not promoted" in st["training"]["error"]
        assert st["ratings"]["pending"] == 12  # a rejected run consumes nothing

        hist = json.loads(rl("history", "--json").output)
        assert hist[0]["verdict"] == "rejected" and "margin fell" in hist[0]["reason"]
        # The smaller step from halfway through the run was judged too, and refused as well.
        assert hist[0]["fallback"] == "refused" and "halfway through the run (step 4) too: " in hist[0]["reason"]
        assert hist[0]["heldout_margin_after"] < hist[0]["heldout_margin_before"]
        # The run's reward model reaches meta.json and the history: both classes were rated.
        assert 0 <= hist[0]["reward_model_auc"] <= 1 and hist[0]["reward_model_auc"] == v["metrics"]["reward_model_auc"]
        # Whether it explored, and why, reaches the history too (exploration is on by default).
        assert hist[0]["explore_reason"] and (hist[0]["explored"], hist[0]["explore_reason"]) == (
            v["metrics"]["explored"], v["metrics"]["explore_reason"])
        assert "rejected" in rl("history").output

        # Not served by accident: neither rollback nor a plain promote takes it.
        res = rl("rollback", "v0001")
        assert res.exit_code != 0 and "promote v0001 --force" in res.output
        assert rl("promote", "v0001").exit_code != 0
        reg = AdapterRegistry(cfg.adapters_root, st["model_slug"])
        assert reg.current() is None
        assert sorted(p.name for p in reg.dir.iterdir() if p.is_dir()) == ["v0001"]  # no staging left behind

        # One more rating does not retry at once on nearly the same data...
        assert _rate(cfg, handle, "owls", GOOD, 1)["training"] is None
        # ...half a threshold of new ones does.
        results = [_rate(cfg, handle, t, GOOD, 1) for t in ("rust", "silk", "wolves", "figs", "lamps")]
        assert results[-1]["training"].startswith("training run")

        res = rl("promote", "v0001", "--force", "--json")
        assert res.exit_code == 0, res.output
        assert reg.current() == "v0001"
        st = status()
        assert st["adapter"]["versions"][0]["status"] == "active"
        assert st["ratings"]["pending"] == 18 - 8  # the forced version consumed what it trained on


def test_a_good_run_is_promoted_and_its_held_out_ratings_train_the_next(gated_home):
    with opened_queue() as (cfg, handle):
        _prefer(cfg, handle, TOPICS[:6], GOOD, BAD)
        _work_train_queue(handle)
        st = status()
        assert st["adapter"]["current"] == "v0001", st["training"]
        m = st["adapter"]["versions"][0]["metrics"]
        assert m["verdict"] == "promoted" and m["heldout_n"] == 4 and m["ratings_used"] == 8
        assert m["heldout_margin_after"] > m["heldout_margin_before"]
        assert st["ratings"]["pending"] == 4
        meta = AdapterRegistry(cfg.adapters_root, st["model_slug"]).meta("v0001")
        assert set(meta["heldout_rating_ids"]).isdisjoint(meta["rating_ids"])


def test_an_exploring_run_adds_answers_the_ledger_never_sees(gated_home):
    cfg = load_config()
    cfg.train.explore, cfg.train.explore_prompts, cfg.train.explore_max_new_tokens = 2, 3, 8
    cfg.save()
    with opened_queue() as (cfg, handle):
        _prefer(cfg, handle, TOPICS[:6], GOOD, BAD)
        _work_train_queue(handle)
        st = status()
        (v,) = st["adapter"]["versions"]
        m = v["metrics"]
        # 8 training ratings (4 liked, 4 disliked; the newest 4 are held out), separable: explored.
        assert m["ratings_used"] == 8 and m["reward_model_auc"] == 1.0
        assert m["explored"] == 2 * 3 and m["explore_reason"].startswith("2 answers to each of 3 prompts")
        meta = AdapterRegistry(cfg.adapters_root, st["model_slug"]).meta(v["version"])
        assert meta["metrics"]["explored"] == 6 and meta["config"]["explore"] == 2
        # The ledger, the EMA and the held-out set see the ratings only.
        assert len(meta["rating_ids"]) == 8 and {int(k) for k in meta["advantages"]} == set(meta["rating_ids"])
        assert len(meta["heldout_rating_ids"]) == 4
        assert st["ratings"]["pending"] == (4 if v["status"] == "active" else 12)
        hist = json.loads(rl("history", "--json").output)
        assert (hist[0]["explored"], hist[0]["explore_reason"]) == (6, m["explore_reason"])


def test_history_marks_a_version_served_from_halfway_through_its_run():
    from rich.console import Console

    from rlfleet.shared.status_view import history_rows, versions_table

    why = "degenerating: next-token entropy 1.34x the base's (> 1.3)"
    versions = [{"version": "v0002", "status": "active", "created": "2026-11-25T23:00:00Z", "parent": "v0001",
                 "metrics": {"verdict": "promoted", "fallback": "halfway", "steps_served": 4, "refused_full": why,
                             "ratings_used": 27, "heldout_margin_before": -0.4, "heldout_margin_after": -0.3}}]
    (row,) = history_rows(versions)
    assert (row["fallback"], row["steps_served"], row["refused_full"]) == ("halfway", 4, why)
    console = Console(width=120, record=True)
    console.print(versions_table(versions))
    assert "promoted (step 4, halfway)" in console.export_text()


def test_history_fits_an_80_column_terminal_one_line_per_version():
    """Every version on one line of at most 80 columns, whatever its reason says: the columns a narrow
    terminal has no room for are left out, and the reasons go under the table in full."""
    from rich.console import Console

    from rlfleet.shared.status_view import versions_table

    why = "degenerating: next-token entropy 1.34x the base's (> 1.3) [checked on 32 held-out prompts]"
    base = {"ratings_used": 27, "replayed": 16, "heldout_margin_before": -0.4, "heldout_margin_after": -0.3,
            "heldout_kl": 0.123, "accepted_token_frac": 0.91, "hinted": 12, "hint_taught": 10,
            "teacher_gap": 0.041}
    versions = [
        {"version": "v0001", "status": "retired", "created": "2026-11-25T22:00:00Z", "parent": None,
         "metrics": {**base, "verdict": "promoted"}},
        {"version": "v0002", "status": "rejected", "created": "2026-11-25T23:00:00Z", "parent": "v0001",
         "metrics": {**base, "verdict": "rejected", "reason": why}},
        {"version": "v0003", "status": "active", "created": "2026-11-26T01:00:00Z", "parent": "v0001",
         "metrics": {**base, "verdict": "promoted", "fallback": "halfway", "steps_served": 4}},
    ]
    for width in (80, 60):
        console = Console(width=width, record=True)
        console.print(versions_table(versions, title="versions (newest last)"))
        lines = console.export_text().splitlines()
        assert all(len(line) <= width for line in lines)
        for v, state, verdict in (("v0001", "retired", "promoted"), ("v0002", "rejected", "rejected"),
                                   ("v0003", "active", "promoted")):
            (row,) = [line for line in lines if line.split()[:2] == [v, state]]
            assert verdict in row and "-0.400 → -0.300" in row
        assert why in " ".join(" ".join(lines).split())  # the reason, wrapped but whole
        assert "v0003 promoted (step 4, halfway)" in lines
    wide = Console(width=160, record=True)
    wide.print(versions_table(versions))
    header = wide.export_text().splitlines()[1]
    assert all(name in header for name in ("created", "ratings", "KL", "acc tok", "hints"))


def test_history_says_when_the_held_out_words_vouched_for_a_version():
    from rich.console import Console

    from rlfleet.shared.status_view import versions_table

    m = {"verdict": "promoted", "ratings_used": 27, "heldout_kl": 0.237, "heldout_margin_before": 1.49,
         "heldout_margin_after": 1.658, "heldout_one_class": True, "heldout_toward_teacher": True,
         "heldout_teacher_div_before": 0.154, "heldout_teacher_div_after": 0.063}
    versions = [{"version": "v0001", "status": "active", "created": "2026-11-28T12:16:00Z", "parent": None,
                 "metrics": m}]
    console = Console(width=140, record=True)
    console.print(versions_table(versions))
    assert "promoted (nearer what the words asked: 0.154 → 0.063)" in console.export_text()
    console = Console(width=140, record=True)
    console.print(versions_table([{**versions[0], "metrics": {**m, "heldout_toward_teacher": False}}]))
    assert "nearer" not in console.export_text()


def test_a_run_reads_the_words_on_its_ratings_and_history_shows_the_teacher_gap(gated_home):
    """Ratings with a comment reach the run as hints (worker/orchestrate.rated_sample): the run
    reports how many came with words, how many the teacher taught from and its mean gap, and `history`
    shows them; bare ratings beside them are not hinted."""
    from rich.console import Console

    from rlfleet.shared.status_view import versions_table

    with opened_queue() as (cfg, handle):
        for i, t in enumerate(TOPICS[:6]):
            _rate(cfg, handle, t, GOOD, 1)
            cap = Capture(prompt=chat(f"Tell me about {t}."), response=BAD, model="external", conversation="g")
            assert dispatch(handle, cfg, cap)["ok"]
            words = "say yes instead" if i % 2 == 0 else None
            assert dispatch(handle, cfg, Rating(value=-1, target=cap.capture_id, comment=words))["ok"]
        _work_train_queue(handle)
        st = status()
        (v,) = st["adapter"]["versions"]
        m = v["metrics"]
        # 8 of the 12 train (the newest 4 are held out); the 👎s with words among them are hinted.
        held = AdapterRegistry(cfg.adapters_root, st["model_slug"]).meta(v["version"])["heldout_rating_ids"]
        assert len(held) == 4 and m["ratings_used"] == 8
        assert 1 <= m["hinted"] <= 3 and m["hint_taught"] <= m["hinted"]
        assert isinstance(m["teacher_gap"], float)
        (row,) = json.loads(rl("history", "--json").output)
        assert (row["hinted"], row["hint_taught"], row["teacher_gap"]) == (m["hinted"], m["hint_taught"],
                                                                          m["teacher_gap"])
        console = Console(width=140, record=True)
        console.print(versions_table(st["adapter"]["versions"]))
        assert f"{m['hint_taught']}/{m['hinted']} {m['teacher_gap']:+.3f}" in console.export_text()
