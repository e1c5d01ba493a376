"""The unlikelihood term's answers: which tokens make an answer repeat itself, and that the term
lowers exactly those tokens on both backends' training path."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_trainer import LEARN, chat, preference_samples

from rlfleet.shared.chat_prompt import prompt_ids
from rlfleet.worker.batching import Encoded
from rlfleet.worker.gate import repeated_ngrams
from rlfleet.worker.objective import unlikelihood
from rlfleet.worker.training.loops import ANSWERS, CHECK_EVERY, LoopPool, batched, check, repeated_positions


def test_repeated_positions_mark_the_tokens_that_complete_an_earlier_trigram():
    assert repeated_positions([1, 2, 3, 1, 2, 3, 1]) == [5, 6]
    assert repeated_positions([1, 2, 3, 4, 5]) == []
    assert repeated_positions([7, 7, 7, 7]) == [3]
    assert repeated_positions([1, 2]) == []


def test_marked_share_is_what_the_gate_counts_as_repetition():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(3, 30))]
        assert len(repeated_positions(tokens)) / (len(tokens) - 2) == pytest.approx(repeated_ngrams(tokens))


def test_each_check_draws_its_answers_from_streams_no_other_check_uses():
    """Row i of a draw is seeded ``seed + i``: checks whose bases were a step apart drew most of their
    rows from the same streams as the check before (correlated answers, fewer independent looks)."""
    drawn: list[list[int]] = []

    class Drawing:
        def sample(self, prompts, max_new_tokens, seed, temperature=0.7, top_p=1.0, seeds=None):
            drawn.append([seed + i for i in range(len(prompts))])
            return [[1, 2, 3, 4] for _ in prompts]  # no repeated trigram: nothing is kept

    samples = [replace(s, prompt=chat(f"Question {i}?")) for i, s in enumerate(preference_samples()[:3])]
    pool = LoopPool()
    for run_seed in (0, 1):
        for step in range(CHECK_EVERY, 12, CHECK_EVERY):
            check(Drawing(), pool, samples, step, run_seed)
    used = [s for batch in drawn for s in batch]
    assert len(drawn) == 10 and all(len(batch) == ANSWERS for batch in drawn)
    assert len(set(used)) == len(used), used
    assert pool.checked == 10 * ANSWERS and not pool.encoded


def check_unlikelihood_lowers_the_marked_tokens(trainer, out) -> None:
    """Four optimizer steps of the unlikelihood term alone on one looping answer: the tokens that
    complete a repeated trigram lose log-prob, far more than an unrelated answer's tokens move."""
    tok = trainer.tokenizer
    prompt = chat("Tell me about cats.")
    text = " ".join(["la", "da", "ba"] * 5)
    answer = tok(text, add_special_tokens=False)["input_ids"]
    marks = repeated_positions(answer)
    assert len(marks) >= 5
    ids = prompt_ids(tok, prompt)
    pool = LoopPool(encoded=[Encoded(input_ids=ids + answer, prompt_len=len(ids))], marks=[marks])
    cfg = replace(LEARN, lr=1e-2)
    other = (chat("What is rain?"), "Water falling from clouds.")
    before = trainer.token_logprobs([(prompt, text)])[0][: len(answer)]
    other_before = trainer.token_logprobs([other])[0]
    with trainer.adapter(None, cfg, trainable=True):
        trainer.begin_training(cfg)
        for _ in range(4):
            trainer.begin_step()
            values = [trainer.accumulate_unlikelihood(b, m, 1.0, share) for b, m, share in batched(trainer, pool, 4096)]
            assert values and all(v > 0 for v in values)
            trainer.finish_step(apply=True)
        trainer.save(out)
    after = trainer.token_logprobs([(prompt, text)], out)[0][: len(answer)]
    drop = [b - a for b, a in zip(before, after, strict=True)]
    marked = sum(drop[t] for t in marks) / len(marks)
    moved = [abs(b - a) for b, a in zip(other_before, trainer.token_logprobs([other], out)[0], strict=True)]
    assert marked > 0.2, drop
    assert marked > 2 * sum(moved) / len(moved), (marked, moved)


def test_unlikelihood_lowers_the_marked_tokens(tiny_trainer, tmp_path):
    check_unlikelihood_lowers_the_marked_tokens(tiny_trainer, tmp_path / "a")


def test_the_unlikelihood_term_reads_the_marked_tokens_alone_with_the_whole_answers_figures(tiny_trainer):
    """The term's pass runs the head at the marked tokens only and stops at the last of them: its value
    and gradients are those of the whole answers' log-probs."""
    tok = tiny_trainer.tokenizer
    answers = [" ".join(["la", "da", "ba"] * 3 + ["one", "two", "three", "four", "five", "six"]),
               " ".join(["so", "me", "so", "me", "so"] + ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"])]
    pool = LoopPool()
    for question, text in zip(("Tell me about cats.", "And dogs?"), answers, strict=True):
        ids, answer = prompt_ids(tok, chat(question)), tok(text, add_special_tokens=False)["input_ids"]
        pool.encoded.append(Encoded(input_ids=ids + answer, prompt_len=len(ids)))
        pool.marks.append(repeated_positions(answer))
    ((batch, marks, share),) = batched(tiny_trainer, pool, 4096)
    last = max(start + m[-1] for _row, start, m in marks)
    assert last + 1 < batch["input_ids"].shape[1]  # the pass is cut short: the answers go on after their loops

    def grads():
        out = [p.grad.clone() for p in tiny_trainer._params]
        tiny_trainer.begin_step()
        return out

    with tiny_trainer.adapter(None, LEARN, trainable=True):
        tiny_trainer.begin_training(LEARN)
        for p in tiny_trainer._params:  # a LoRA away from zero, so that every weight gets a gradient
            p.data.normal_(0, 0.05)
        tiny_trainer.begin_step()
        value = tiny_trainer.accumulate_unlikelihood(batch, marks, 1.0, share)
        fast = grads()
        hit = torch.zeros_like(batch["response_mask"])
        for row, start, positions in marks:
            hit[row, [start + t for t in positions]] = True
        whole = unlikelihood(tiny_trainer._logprobs(batch), batch["response_mask"], hit)
        whole.backward()
        slow = grads()
        unmarked = [(row, start, []) for row, start, _m in marks]
        assert tiny_trainer.accumulate_unlikelihood(batch, unmarked, 1.0, share) == 0.0
        assert all(p.grad is None for p in tiny_trainer._params)  # nothing marked: no gradient
    assert value == pytest.approx(float(whole.detach()), rel=1e-5)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_a_run_with_unlikelihood_checks_its_own_answers_every_few_steps(tiny_trainer, tmp_path):
    assert LEARN.unlikelihood > 0  # the presets' default
    cfg = replace(LEARN, unlikelihood=1.0)
    metrics = tiny_trainer.run(preference_samples(), None, cfg, None, tmp_path / "a").metrics
    checks = len(range(CHECK_EVERY, cfg.steps, CHECK_EVERY))
    assert metrics["loop_checked"] == ANSWERS * checks
    assert 0 <= metrics["loop_answers"] <= metrics["loop_checked"]
    assert 0.0 <= metrics["loop_marked_share"] <= 1.0
    off = replace(LEARN, steps=3, unlikelihood=0.0)
    off = tiny_trainer.run(preference_samples()[:4], None, off, None, tmp_path / "b").metrics
    assert "loop_checked" not in off
