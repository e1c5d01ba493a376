"""OpenAI's ``stop`` (shared/stop_strings.py): a streamed answer sends exactly what the whole one says,
however its pieces fall, and a cut answer keeps the tokens whose text lies before the stop."""

from __future__ import annotations

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
    assert cut_answer(answer, ["zzz"], tok) is answer and cut_answer(answer, [], tok) is answer
    # A character the byte-level tokens spell in several pieces is kept whole with what follows it.
    ids = tok.encode("one \U0001f389 two. three", add_special_tokens=False)
    emoji = Answer(text=tok.decode(ids).strip(), token_ids=ids, logprobs=[0.0] * len(ids), adapter_version=None,
                   model="m", seconds=0.0, new_tokens=len(ids), prompt_tokens=3)
    cut = cut_answer(emoji, [". three"], tok)
    assert cut.text == "one \U0001f389 two" and tok.decode(cut.token_ids).strip() == "one \U0001f389 two"
