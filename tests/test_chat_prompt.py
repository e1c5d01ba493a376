"""shared/chat_prompt: one rendering of a conversation for the responder, llama.cpp and the trainers; a
conversation ending with an assistant message is a prefill the answer continues, and a step answered
after one is trained on the very tokens it was drawn after."""

from __future__ import annotations

import pytest

from bench.synthetic import byte_tokenizer
from rlfleet.shared.chat_prompt import continues, prompt_ids, token_ids
from rlfleet.worker.batching import encode_sample
from rlfleet.worker.samples import TrainSample

ASK = [{"role": "system", "content": "Play."}, {"role": "user", "content": "You: 14. Dealer: 10."}]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_a_users_turn_gets_the_generation_prompt_and_a_prefill_is_left_open(tok):
    asked = prompt_ids(tok, ASK)
    assert tok.decode(asked).endswith("<|im_start|>assistant\n")
    prefilled = prompt_ids(tok, [*ASK, {"role": "assistant", "content": "Action:"}])
    # the same tokens as the generation prompt, then the prefix, and no end token after it
    assert prefilled == asked + token_ids(tok("Action:", add_special_tokens=False))
    assert not continues(ASK) and continues([*ASK, {"role": "assistant", "content": "Action:"}])


def test_a_blank_prefill_is_refused(tok):
    with pytest.raises(ValueError, match="prefill"):
        prompt_ids(tok, [*ASK, {"role": "assistant", "content": "  "}])


def test_an_answer_after_a_prefill_keeps_its_behaviour_log_probs(tok):
    prompt = [*ASK, {"role": "assistant", "content": "Action:"}]
    drawn = token_ids(tok(" 1", add_special_tokens=False)) + [tok.eos_token_id]
    sample = TrainSample(rating_id=1, prompt=prompt, response=" 1", reward=1.0,
                         behaviour_logprobs=[-0.5] * len(drawn), behaviour_token_ids=drawn)
    enc = encode_sample(tok, sample, max_tokens=512)
    assert enc.input_ids[: enc.prompt_len] == prompt_ids(tok, prompt)
    assert enc.input_ids[enc.prompt_len:] == drawn and enc.behaviour_logprobs == [-0.5] * len(drawn)
    # the same answer stored stripped ("1") is another tokenisation: its log-probs are not paired with it
    stripped = encode_sample(tok, TrainSample(rating_id=1, prompt=prompt, response="1", reward=1.0,
                                              behaviour_logprobs=[-0.5] * len(drawn), behaviour_token_ids=drawn),
                             max_tokens=512)
    assert stripped.behaviour_logprobs is None
