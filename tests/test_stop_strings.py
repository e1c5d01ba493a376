"""OpenAI's ``stop`` (shared/stop_strings.py): a streamed answer sends exactly what the whole one says,
however its pieces fall, and a cut answer keeps the tokens whose text lies before the stop."""

from __future__ import annotations

import dataclasses

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rlfleet.shared.responder import Answer
from rlfleet.shared.stop_strings import StopFilter, cut_answer, earliest_stop

TEXT = st.text(alphabet="ab \n.", max_size=40)


def drawn_until_a_stop(text: str, stops: list[str]) -> str | None:
    """What an engine that checks for a stop string after every character it draws answers (None: it
    drew ``text`` to its end): the text before the stop string the last character completed."""
    for k in range(1, len(text) + 1):
        begun = [k - len(s) for s in stops if text[:k].endswith(s)]
        if begun:
            return text[:min(begun)]
    return None


@settings(max_examples=300, deadline=None)
@given(text=TEXT, stops=st.lists(st.text(alphabet="ab \n.", min_size=1, max_size=3), min_size=1, max_size=4),
       cuts=st.lists(st.integers(1, 5), max_size=40))
@example(text="a\na", stops=["\n", "a\na"], cuts=[1, 1])  # the longer one begins first but completes later
@example(text="ab", stops=["b", "ab"], cuts=[1])  # both complete at the "b": the answer ends before the "a"
def test_the_stream_sends_exactly_the_text_before_the_first_stop(text, stops, cuts):
    f, sent, i = StopFilter(stops), [], 0
    for n in cuts + [len(text)]:
        sent.append(f.feed(text[i:i + n]))
        i += n
    sent.append(f.flush())
    drawn = drawn_until_a_stop(text, stops)
    assert "".join(sent) == (text if drawn is None else drawn)
    at = earliest_stop(text, stops)  # what a whole answer is cut to
    assert (text if at is None else text[:at]) == "".join(sent)
    assert f.stopped == (drawn is not None)


def test_a_cut_answer_keeps_the_tokens_before_the_stop(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("one two three. four five", add_special_tokens=False) + [tok.eos_token_id]
    answer = Answer(text=tok.decode(ids, skip_special_tokens=True).strip(), token_ids=ids,
                    logprobs=[-0.5] * len(ids), adapter_version=None, model="m", seconds=0.0, new_tokens=len(ids),
                    prompt_tokens=3)
    cut = cut_answer(answer, [". four", "zzz"], tok)
    assert cut.text == "one two three" and cut.finish_reason == "stop"
    assert tok.decode(cut.token_ids).strip() == "one two three" and ids[:len(cut.token_ids)] == cut.token_ids
    assert cut.new_tokens == len(cut.token_ids) == len(cut.logprobs) < len(ids)
    # a drawing stopped by a stop string of whitespace ends in it, though the answer's text is stripped
    ids = tok.encode("one two\n", add_special_tokens=False)
    cut = cut_answer(dataclasses.replace(answer, text="one two", token_ids=ids, logprobs=[-0.5] * len(ids),
                                         new_tokens=len(ids), finish_reason="length"), ["\n"], tok)
    assert (cut.text, cut.finish_reason) == ("one two", "stop") and tok.decode(cut.token_ids) == "one two"
    assert cut_answer(answer, ["zzz"], tok) is answer and cut_answer(answer, [], tok) is answer
    # A character the byte-level tokens spell in several pieces is kept whole with what follows it.
    ids = tok.encode("one \U0001f389 two. three", add_special_tokens=False)
    emoji = Answer(text=tok.decode(ids).strip(), token_ids=ids, logprobs=[0.0] * len(ids), adapter_version=None,
                   model="m", seconds=0.0, new_tokens=len(ids), prompt_tokens=3)
    cut = cut_answer(emoji, [". three"], tok)
    assert cut.text == "one \U0001f389 two" and tok.decode(cut.token_ids).strip() == "one \U0001f389 two"


def test_a_stop_check_fires_at_the_token_that_completes_a_stop_string(tiny_model_dir):
    from transformers import AutoTokenizer

    from rlfleet.shared.stop_strings import StopCheck

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok.encode("one two three. four five \u2603 six", add_special_tokens=False)
    for stop in [". four", "\u2603", "e", "one two three. four five"]:
        check = StopCheck(tok, [[], ["zzz", stop]])
        first = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
        assert [check(1, ids[:k]) for k in range(1, first + 1)] == [False] * (first - 1) + [True], stop
        assert not any(check(0, ids[:k]) for k in range(1, len(ids) + 1))  # row 0 has no stop strings
    assert not StopCheck(tok, [[], []]) and StopCheck(tok, [[], ["x"]])


def early_stops(r, convs: list[list[dict]], **sampling) -> tuple[str, int, list[int]]:
    """``r`` (a LocalResponder) draws an answer only up to the token that completes its stop string,
    alone (streamed) or as a row of a batch beside a row without one; the answer is cut where the string
    begins. Returns the batch's stop string, how many tokens complete it, and the batch's uncut row."""
    tok = r.tokenizer

    def pick(ids: list[int]) -> tuple[str, int]:
        """A few characters of the answer after which it draws a few more tokens, and how many of its
        tokens complete them."""
        text = tok.decode(ids, skip_special_tokens=True)
        for stop in (text[i:i + n] for n in (3, 2, 1) for i in range(len(text) - n)):
            if stop.strip() and "\ufffd" not in stop:
                k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
                if k < len(ids) - 3:
                    return stop, k
        raise AssertionError(f"no stop string to try in {text!r}")

    alone = r.answer(convs[0], max_new_tokens=24, **sampling)
    stop, k = pick(alone.token_ids)
    pieces: list[str] = []
    one = r.answer(convs[0], max_new_tokens=24, stop=[stop], on_text=pieces.append, **sampling)
    assert "".join(pieces) == tok.decode(alone.token_ids[:k], skip_special_tokens=True)  # drawn no further
    drawn = tok.decode(alone.token_ids, skip_special_tokens=True)
    assert one.text == drawn[:drawn.find(stop)].strip() and one.finish_reason == "stop"
    assert one.token_ids == alone.token_ids[:len(one.token_ids)] and len(one.logprobs) == len(one.token_ids) < k

    full = r.answer_many(convs, max_new_tokens=24, **sampling)
    stop, k = pick(full[0].token_ids)
    many = r.answer_many(convs, max_new_tokens=24, stops=[[stop], []], **sampling)
    drawn = tok.decode(full[0].token_ids, skip_special_tokens=True)
    assert many[0].text == drawn[:drawn.find(stop)].strip() and many[0].finish_reason == "stop"
    assert many[0].token_ids == full[0].token_ids[:len(many[0].token_ids)]
    assert many[1].token_ids == full[1].token_ids and many[1].text == full[1].text
    return stop, k, full[0].token_ids


def test_a_stop_string_ends_the_drawing_alone_and_in_a_batch(tiny_model_dir, tmp_path):
    from rlfleet.shared.models import resolve_model
    from rlfleet.shared.responder import LocalResponder
    from rlfleet.shared.stop_strings import StopCheck

    r = LocalResponder(resolve_model(str(tiny_model_dir)), tmp_path, max_new_tokens=24)
    convs = [[{"role": "user", "content": "Say more."}], [{"role": "user", "content": "And then?"}]]
    stop, k, ids = early_stops(r, convs, temperature=1.0, seed=3)
    with r._lock:  # the batch as drawn, before the cut: the stopped row holds nothing past its stop
        chosen = r._select(None)
        with chosen.context:
            batch = r._generate_batch(chosen, convs, 3, 24, 1.0, r.top_p, stop=StopCheck(r.tokenizer, [[stop], []]))
    drawn = batch.news[0].tolist()
    assert drawn[:k] == ids[:k] and r.tokenizer.decode(drawn[k:], skip_special_tokens=True) == ""
