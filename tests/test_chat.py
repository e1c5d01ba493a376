"""`rlfleet chat` as a person meets it, through a real pseudo-terminal: training news appears while the
user types (without a key pressed) and what they typed stays theirs; a run's end is said at once, with
what changed or why not and what happens next; the trigger's "already running" is said once per run."""

from __future__ import annotations

import os
import sys
import time

from ptyrig import PtySession
from transformers import AutoTokenizer

from rlfleet.bots.training_news import TrainingNews
from rlfleet.shared.config import load_config
from rlfleet.shared.events import Capture, Message, Rating
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import TRAINING_BUSY, progress_key, train_lock_key
from rlfleet.shared.store import Store

TRIES = 14
SEEN = 20  # seconds a line may take to show (the chat polls every second; the machine may be busy)


def _finish(store: Store, slug: str, run_id: int, promote: bool, reason: str | None = None) -> None:
    store.finish_run(run_id, model=slug, version=f"v{run_id:04d}", parent=None, advantages={}, retracted=[],
                     new_ema=0.0, promote=promote, reason=reason,
                     metrics={"heldout_margin_before": -0.25, "heldout_margin_after": 0.5, "ratings_used": 12})


def test_training_news_reaches_the_prompt_live_and_keeps_what_was_typed(queued_home, tiny_model_dir, rconn,
                                                                         monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    earlier = store.create_run(slug)
    store.start_run(earlier, None)
    _finish(store, slug, earlier, promote=False, reason="held-out margin fell from +0.100 to -0.200")
    child = PtySession([sys.executable, "-m", "rlfleet.cli", "chat", "--no-worker"], os.environ.copy())
    try:
        child.expect("✗ v0001 rejected: held-out margin fell from +0.100 to -0.200; ratings stay pending", timeout=120)
        child.expect("you> ", timeout=120)
        child.send("/ne")  # half a command typed, no Enter
        run_id = store.create_run(slug)
        rconn.set(train_lock_key(slug), f"rlfleet-train-{slug}-{run_id}")
        store.start_run(run_id, None)
        rconn.hset(progress_key(slug), mapping={"phase": "training", "step": 3, "total": 8, "tokens_per_s": 0,
                                                "version": "v0002"})
        child.expect("training v0002: training step 3/8", timeout=SEEN)
        child.expect("you> /ne", timeout=SEEN)  # the typed text, drawn again under the news
        rconn.hset(progress_key(slug), "step", 5)
        child.expect("training v0002: training step 5/8", timeout=SEEN)
        child.send("w\r")
        child.expect("new conversation", timeout=SEEN)  # the chat got "/new": the text was kept
        _finish(store, slug, run_id, promote=True)
        rconn.delete(train_lock_key(slug), progress_key(slug))
        child.expect("✓ v0002 promoted: held-out margin -0.250 → +0.500 on 12 ratings; now answering with it",
                           timeout=SEEN)
        child.send("/quit\r")
        assert child.wait(timeout=60) == 0
    finally:
        child.close()


def test_quit_during_a_training_run_stops_quietly_and_says_the_run_comes_back(queued_home, tiny_model_dir,
                                                                            monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    cfg.train.steps = 10_000  # still training when the user leaves
    cfg.train.max_tokens = 96
    cfg.save()
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    for i in range(4):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content=f"q{i}")],
                                    response=f"answer {i}", model="external"))
        store.apply_rating(Rating(target=f"c{i}", value=1 if i % 2 else -1), slug)
    child = PtySession([sys.executable, "-m", "rlfleet.cli", "chat"], os.environ.copy())
    try:
        child.expect("you> ", timeout=120)
        child.send("/rl train\r")
        child.expect("training v0001: training step", timeout=180)
        child.send("/quit\r")
        child.expect("training run 1 stopped; it runs the next time `rlfleet chat` or `rlfleet up` starts",
                     timeout=60)
        assert child.wait(timeout=60) == 0
    finally:
        child.close()
    log = (cfg.home / "logs" / "worker-train.log").read_text()
    assert "Traceback" not in log and "stopped during training run 1" in log, log
    assert store.get_run(1).error.startswith("interrupted: stopped on request")


def _ask_until_rateable(child: PtySession, question: str) -> None:
    """Ask until an answer is captured: the tiny model's random bytes may hold a NUL, which the chat
    refuses to capture (and says so) or be only white space (nothing to rate): about one try in two, so
    enough tries that a test asking four questions does not fail on chance."""
    for _ in range(TRIES):
        child.send(f"{question}\r")
        if child.expect_first(["skip > ", "not captured: ", "nothing to rate"], timeout=120) == "skip > ":
            return
        child.expect("you> ", timeout=SEEN)
    raise AssertionError(f"no rateable answer to {question!r} in {TRIES} tries; the screen ended with:\n"
                         f"{child.raw[-2000:]}")


def test_the_rating_prompt_takes_a_key_a_comment_a_reason_and_a_typed_rl_command(queued_home, tiny_model_dir,
                                                                                  monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    cfg.train.threshold = 1000  # no training run starts
    cfg.save()
    child = PtySession([sys.executable, "-m", "rlfleet.cli", "chat"], os.environ.copy())
    try:
        child.expect("you> ", timeout=120)
        _ask_until_rateable(child, "What is rain?")
        child.send("x\r")
        child.expect("press 1, 2, c, or enter (or type /rl good, /rl bad [why])", timeout=SEEN)
        child.send("c\r")
        child.expect("comment> ", timeout=SEEN)
        child.send("wordy\r")
        child.expect("skip > ", timeout=SEEN)
        child.send("2\r")
        child.expect("you> ", timeout=SEEN)
        _ask_until_rateable(child, "And snow?")
        child.send("/rl bad too long\r")
        child.expect("you> ", timeout=SEEN)
        child.send("/rl why far too long\r")  # the reason, changed afterwards
        child.expect("noted why it is bad: far too long", timeout=SEEN)
        _ask_until_rateable(child, "And hail?")
        child.send("2\r")  # a 👎 without a comment: one of the reasons, in one key
        child.expect("why? [1] too long  [2] too short  [3] wrong  [4] off-topic  [5] tone  [o] other", timeout=SEEN)
        child.send("9\r")
        child.expect("press 1-5, o, or enter", timeout=SEEN)
        child.send("3\r")
        child.expect("rated bad", timeout=SEEN)
        _ask_until_rateable(child, "And fog?")
        child.send("2\r")
        child.expect("skip > ", timeout=SEEN)
        child.send("o\r")  # other: their own words
        child.expect("why> ", timeout=SEEN)
        child.send("grey and vague\r")
        child.expect("rated bad", timeout=SEEN)
        _ask_until_rateable(child, "And dew?")
        child.send("/new\r")  # a chat command at the rating prompt skips the rating and is carried out
        child.expect("new conversation", timeout=SEEN)
        _ask_until_rateable(child, "And frost?")
        child.send("/quit\r")  # leaves at once, unrated
        assert child.wait(timeout=60) == 0
    finally:
        child.close()
    store = Store(cfg.db_url)
    deadline = time.monotonic() + 60
    while len(rated := store.rated_pairs(all_states=True)) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)  # the chat's worker applies what the chat acknowledged
    got = sorted((c.prompt[-1]["content"], r.value, r.comment, r.state) for r, c in rated)
    assert got == [("And fog?", -1, "grey and vague", "active"), ("And hail?", -1, "wrong", "active"),
                   ("And snow?", -1, "far too long", "active"), ("And snow?", -1, "too long", "replaced"),
                   ("What is rain?", -1, "wordy", "active")]
    eos = AutoTokenizer.from_pretrained(tiny_model_dir).eos_token_id  # how each answer ended is recorded
    assert all(c.finish_reason == ("stop" if c.behaviour_token_ids[-1] == eos else "length") for _, c in rated)


def test_a_rejected_run_says_why_and_when_the_next_one_comes(home):
    cfg = load_config()
    store, slug = Store(cfg.db_url), "m"
    cfg.train.threshold = 8
    for i in range(6):
        store.apply_capture(Capture(capture_id=f"c{i}", prompt=[Message(role="user", content="q")],
                                    response="a", model="m"))
        store.apply_rating(Rating(target=f"c{i}", value=1), slug)
    news = TrainingNews(store, None, slug, cfg.train.threshold)
    assert news.poll().ended == []
    run_id = store.create_run(slug)
    store.start_run(run_id, None)
    assert news.poll().ended == []  # running: nothing ended yet
    _finish(store, slug, run_id, promote=False, reason="held-out margin fell from +0.100 to -0.200")
    (said,) = news.poll().ended
    assert said == ("✗ v0001 rejected: held-out margin fell from +0.100 to -0.200; "
                    "ratings stay pending, next run after 4 more")  # half a threshold of new ones
    assert news.poll().ended == []  # said once
    assert TrainingNews(store, None, slug, 8).poll().ended == []  # a chat started later: old news


def test_a_run_that_ends_while_training_is_paused_does_not_promise_the_next(home):
    store, slug = Store(load_config().db_url), "m"
    news = TrainingNews(store, None, slug, 8)
    run_id = store.create_run(slug)
    store.start_run(run_id, None)
    store.pause_training(slug, True)
    _finish(store, slug, run_id, promote=False, reason="held-out margin fell")
    (said,) = news.poll().ended
    assert said == ("✗ v0001 rejected: held-out margin fell; ratings stay pending; automatic training is paused "
                    "(/rl resume, or /rl train for a run now)")


def test_already_running_is_said_once_per_run(home):
    store, slug = Store(load_config().db_url), "m"
    news = TrainingNews(store, None, slug, 8)
    first = store.create_run(slug)
    assert news.about_trigger(TRAINING_BUSY) == TRAINING_BUSY
    assert news.about_trigger(TRAINING_BUSY) is None
    assert news.about_trigger("training run 2 queued on 8 ratings") == "training run 2 queued on 8 ratings"
    _finish(store, slug, first, promote=True)
    store.create_run(slug)
    assert news.about_trigger(TRAINING_BUSY) == TRAINING_BUSY  # a new run: said again, once
    assert news.about_trigger(TRAINING_BUSY) is None


def test_a_promotion_says_when_the_halfway_step_or_the_held_out_words_carried_it(queued_home, tiny_model_dir,
                                                                                 monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    cfg = load_config()
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    news = TrainingNews(store, None, slug, cfg.train.threshold)
    run_id = store.create_run(slug)
    store.start_run(run_id, None)
    why = "degenerating: sampled answers repeat 12% of their trigrams (base 1%)"
    store.finish_run(run_id, model=slug, version="v0001", parent=None, advantages={}, retracted=[], new_ema=0.0,
                     promote=True, reason=None,
                     metrics={"heldout_margin_before": -0.25, "heldout_margin_after": 0.5, "ratings_used": 12,
                              "fallback": "halfway", "steps_served": 4, "refused_full": why})
    (said,) = news.poll().ended
    assert said == ("✓ v0001 promoted: held-out margin -0.250 → +0.500 on 12 ratings (the step from halfway "
                    f"through the run: the whole run was refused, {why}); now answering with it")
    run_id = store.create_run(slug)
    store.start_run(run_id, "v0001")
    store.finish_run(run_id, model=slug, version="v0002", parent="v0001", advantages={}, retracted=[], new_ema=0.0,
                     promote=True, reason=None,
                     metrics={"heldout_margin_before": 1.49, "heldout_margin_after": 1.658, "ratings_used": 27,
                              "heldout_one_class": True, "heldout_toward_teacher": True})
    (said,) = news.poll().ended
    assert said == ("✓ v0002 promoted: held-out margin +1.490 → +1.658 on 27 ratings (only 👎s held out: it came "
                    "nearer what their words asked); now answering with it")


def test_words_no_event_takes_are_said_in_the_chat_and_nothing_is_sent(capsys):
    """`/rl bad|why` with a NUL byte in the words: the event contract refuses them; the chat says so
    and goes on, and nothing reaches the queue (a valid line next to it does)."""
    from rlfleet.bots import terminal
    from rlfleet.shared.config import Config
    from rlfleet.shared.ingress.usecases import UseCases
    from rlfleet.shared.permissions import PermissionTable

    cfg = Config()
    sent: list = []

    def dispatch(_handle, _cfg, event):
        sent.append(event)
        return {"ok": False, "message": "held here"}

    state = terminal.ChatState(conversation="chat-t", history=[], screen=terminal.Screen(live=False), news=None,
                               cases=UseCases(PermissionTable.for_config(cfg), cfg.model), dispatch=dispatch,
                               last_capture="cap-1")
    for line in ("/rl bad too\x00long", "/rl why far\x00too long"):
        terminal._command(line, state, cfg, None)
        assert "could not record that" in capsys.readouterr().out
    assert sent == []
    terminal._command("/rl why far too long", state, cfg, None)
    terminal._command("/rl 2 still too long", state, cfg, None)  # stars, from the chat as anywhere
    assert [(e.value, e.stars, e.comment) for e in sent] == [(None, None, "far too long"), (-1, 2, "still too long")]


def test_pause_and_resume_typed_in_the_chat_reach_the_worker_as_the_local_admin(queued_home, capsys):
    from rlfleet.bots import terminal
    from rlfleet.cli import dispatch
    from rlfleet.shared.ingress.usecases import UseCases
    from rlfleet.shared.permissions import PermissionTable
    from rlfleet.shared.queue import open_queue

    cfg = load_config()
    store, slug = Store(cfg.db_url), model_slug(cfg.model)
    handle = open_queue(cfg)
    try:
        state = terminal.ChatState(conversation="chat-t", history=[], screen=terminal.Screen(live=False),
                                   news=TrainingNews(store, handle.redis, slug, cfg.train.threshold),
                                   cases=UseCases(PermissionTable.for_config(cfg), cfg.model, handle),
                                   dispatch=dispatch)
        terminal._command("/rl pause", state, cfg, handle)
        assert "automatic training paused" in capsys.readouterr().out and store.training_paused(slug)
        terminal._command("/rl resume", state, cfg, handle)
        assert "automatic training resumed" in capsys.readouterr().out and not store.training_paused(slug)
    finally:
        handle.close()
