"""Events are validated at the edge: malformed input is refused with one clear line."""

import json

import pytest

from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import Capture, Rating, finish_reason, known_finish_word, parse_event, well_formed


def _capture(**kw):
    base = {"type": "capture", "prompt": [{"role": "user", "content": "hi"}], "response": "hello", "model": "m"}
    base.update(kw)
    return base


def test_round_trip_through_json_keeps_every_field():
    cap = Capture(prompt=[{"role": "user", "content": "hi"}], response="yo", model="m", behaviour_logprobs=[-0.5])
    back = parse_event(cap.model_dump_json())
    assert back == cap


def test_rating_value_must_be_plus_or_minus_one():
    with pytest.raises(BadInput, match="value"):
        parse_event({"type": "rating", "value": 3})


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"{not json", "invalid event"),
        (json.dumps({"type": "nope"}).encode(), "type"),
        (json.dumps(_capture(response="   ")).encode(), "response is empty"),
        (json.dumps(_capture(prompt=[])).encode(), "prompt"),
        (json.dumps(_capture(prompt=[{"role": "user", "content": "x" * 10_000_000}])).encode(), "limit"),
        (json.dumps(_capture(extra_field=1)).encode(), "extra"),
        (json.dumps(_capture(response="a\x00b")).encode(), "NUL"),
        (_capture(response="\ud800"), "UTF-8"),  # a lone surrogate from a bad decode
        (json.dumps(_capture(response="\ud800")).encode(), "invalid"),
        (json.dumps({"type": "command", "name": "format-disk"}).encode(), "name"),
        # an argument the command does not read (a typo'd `force`), or of the wrong type
        (json.dumps({"type": "command", "name": "promote", "args": {"version": "v2", "froce": True}}).encode(),
         "promote takes no argument froce (it takes: scope, version, force)"),
        (json.dumps({"type": "command", "name": "reset", "args": {"purge_ratings": "no"}}).encode(),
         "reset's purge_ratings must be true or false"),
        (json.dumps({"type": "command", "name": "rollback", "args": {"version": True}}).encode(),
         "rollback's version must be a string or a number"),
        (json.dumps({"type": "command", "name": "train", "args": {"\n" * 80: 1}}).encode(),
         "train takes no argument '\\n"),
        # a rating's target `last` is the latest answer: an answer of that id or ref could never be rated
        (json.dumps(_capture(capture_id="last")).encode(), "'last' is reserved"),
        (json.dumps(_capture(message_ref="last")).encode(), "'last' is reserved"),
        # a made-up field name is shown escaped and cut short (the nightly fuzz sent {"\n": null})
        (json.dumps({"type": "undo", "\n": None}).encode(), "'\\n': extra inputs"),
        (json.dumps({"type": "undo", "x" * 5000: None}).encode(), "'" + "x" * 40 + "'…: extra inputs"),
    ],
)
def test_bad_input_is_one_clear_line(payload, fragment):
    with pytest.raises(BadInput) as info:
        parse_event(payload)
    msg = str(info.value)
    assert "\n" not in msg and fragment.lower() in msg.lower()


def test_event_id_is_unique_per_event():
    a, b = Rating(value=1), Rating(value=1)
    assert a.event_id != b.event_id


def test_well_formed_replaces_lone_surrogates_and_keeps_the_rest():
    assert well_formed("a\ud800b\udcff") == "a\ufffdb\ufffd"
    assert well_formed(json.loads('"\\ud83d\\ude00 ok"')) == "\U0001f600 ok"  # an escaped pair is one character
    assert well_formed("plain é 🙃") == "plain é 🙃"
    Capture(**{**_capture(), "response": well_formed("x\ud83d")})  # what it returns is storable


def test_each_apis_finish_word_says_whether_a_cap_cut_the_answer_off():
    assert [finish_reason(w) for w in ("stop", "end_turn", "tool_calls", "length", "max_tokens",
                                       "max_output_tokens")] == ["stop"] * 3 + ["length"] * 3
    assert [finish_reason(w) for w in ("content_filter", "sideways", None, 3)] == [None] * 4  # nothing known
    assert known_finish_word("max_tokens") == "max_tokens"
    with pytest.raises(ValueError, match="'lenght' is not one of stop, end_turn"):
        known_finish_word("lenght")
    assert parse_event(_capture(finish_reason="length")).finish_reason == "length"
    assert parse_event(_capture()).finish_reason is None
    with pytest.raises(BadInput, match="finish_reason"):  # the event carries the normalised word only
        parse_event(_capture(finish_reason="max_tokens"))
