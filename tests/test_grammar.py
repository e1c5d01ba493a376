"""The one `/rl` grammar (rlfleet.shared.ingress.grammar) and the reply wording every front end shares."""

from __future__ import annotations

import pytest

from rlfleet.shared.ingress.grammar import is_rl, parse_rl, reaction_value
from rlfleet.shared.ingress.reasons import REASONS, menu, reason_for
from rlfleet.shared.ingress.replies import NOT_YET_RECORDED, status_line, worker_answer


@pytest.mark.parametrize("text,verb,arg", [
    ("good", "good", None), ("/rl good  nice one ", "good", "nice one"), ("/rl@rlfleet_bot bad", "bad", None),
    ("rl undo", "undo", None), ("+1", "good", None), ("rollback v0003", "rollback", "v0003"),
    ("STATUS", "status", None), ("", "help", None), ("dance", "help", None), ("x" * 5000, "help", None),
    ("/rl why too long", "why", "too long"), ("because", "why", None),
    ("/rl pause", "pause", None), ("PAUSE for a while", "pause", "for a while"),
    ("/rl reset person:slack:U1", "reset", "person:slack:U1"),
    ("status channel:slack:C1", "status", "channel:slack:C1"), ("rl resume", "resume", None),
    ("pauses", "help", None), ("unpause", "help", None),
])
def test_parse_rl(text, verb, arg):
    cmd = parse_rl(text)
    assert (cmd.verb, cmd.arg) == (verb, arg)
    assert cmd.admin == (verb in ("train", "rollback", "reset", "pause", "resume"))


@pytest.mark.parametrize("name,value", [
    ("+1", 1), ("thumbsup", 1), ("+1::skin-tone-4", 1), ("👍", 1), ("👍🏽", 1), ("like", 1),
    ("1f44d_thumbsup", 1), ("1f44d_thumbsup_2", 1), (":thumbsup:", 1),
    ("-1", -1), ("thumbsdown", -1), ("👎🏻", -1), ("1f44e_thumbsdown_5", -1),
    ("heart", None), ("🔥", None), ("", None), (None, None), ("laugh", None),
])
def test_reaction_value(name, value):
    assert reaction_value(name) == value


@pytest.mark.parametrize("text,plain,slash_optional", [
    ("/rl good", True, True), ("  /RL bad meh", True, True), ("/rl@rlfleet_bot undo", True, True),
    ("/rlfoo", True, True),  # still ours: the grammar answers with what it did not understand
    ("rl good", False, True), ("RL", False, True), ("rl", False, True),
    ("rlfleet is great", False, False), ("world /rl", False, False), ("", False, False), ("rl\tgood", False, False),
])
def test_is_rl_tells_commands_from_messages_for_the_model(text, plain, slash_optional):
    assert is_rl(text) is plain
    assert is_rl(text, slash_optional=True) is slash_optional


def test_every_rl_text_parses_the_same_with_and_without_its_prefix():
    for text in ("good nice one", "bad", "undo", "status", "rollback v0002", "train", "reset", "pause", "resume",
                 "dance"):
        assert parse_rl("/rl " + text) == parse_rl(text) == parse_rl("rl " + text) == parse_rl("/rl@bot " + text)


def test_the_workers_answer_in_one_line():
    assert worker_answer(None) == NOT_YET_RECORDED
    assert worker_answer({"ok": True, "message": "rated good: hi"}) == "rated good: hi"
    assert worker_answer({"ok": True, "message": "rated bad: x", "training": "training run 3 queued"}) == \
        "rated bad: x · training run 3 queued"
    assert worker_answer({"ok": False}) == "failed"
    assert worker_answer({"ok": True}) == "done"


def test_status_line():
    assert status_line(None).startswith("no status yet")
    st = {"model": "m", "threshold": 32, "adapter": {"current": "v0002"},
          "ratings": {"total": 5, "good": 3, "bad": 2, "pending": 4},
          "training": {"state": "running", "progress": {"phase": "training", "step": 2, "total": 8}}}
    assert status_line(st) == ("serving v0002 of m · 5 ratings (3 good, 2 bad), 4/32 toward the next training "
                               "run · training training 2/8")
    assert status_line({**st, "training": {"state": "failed", "error": "boom"}}).endswith(" · last run: boom")
    paused = status_line({**st, "training": {"state": "idle", "paused": True}})
    assert paused.endswith(" · training paused: no run starts by itself until an admin's /rl resume")
    assert "paused" not in status_line({**st, "training": {"state": "idle", "paused": False}})


def test_a_one_click_reason_is_its_number_or_its_words():
    assert [reason_for(c) for c in ("1", " 5 ", "Too Long", "tone")] == ["too long", "tone", "too long", "tone"]
    assert [reason_for(c) for c in ("0", "6", "o", "other", "because", "")] == [None] * 6
    assert menu().startswith("[1] too long  [2] too short") and menu().endswith(f"[{len(REASONS)}] tone  [o] other")


@pytest.mark.parametrize("text, verb, stars, arg", [
    ("/rl 4", "good", 4, None), ("/rl 5 spot on", "good", 5, "spot on"), ("/rl 3", "bad", 3, None),
    ("/rl 1 wrong year", "bad", 1, "wrong year"), ("/rl 4/5", "good", 4, None), ("/rl 2★", "bad", 2, None),
    ("/rl ★★★★★", "good", 5, None), ("/rl +1", "good", None, None), ("/rl -1", "bad", None, None),
])
def test_stars_rate_good_from_four_and_bad_below(text, verb, stars, arg):
    cmd = parse_rl(text)
    assert (cmd.verb, cmd.stars, cmd.arg) == (verb, stars, arg)


@pytest.mark.parametrize("text", ["/rl 0", "/rl 6", "/rl 45", "/rl ★★★★★★", "/rl 4.5"])
def test_stars_outside_one_to_five_are_not_understood(text):
    cmd = parse_rl(text)
    assert cmd.verb == "help" and cmd.unknown and cmd.stars is None
