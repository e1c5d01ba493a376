"""The trainer's own batched draws (worker/training/decoding.py): the sampling rule, per-row streams,
rows leaving the batch as they end, and a LoRA folded into the bf16 weights a draw runs on."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlfleet.worker.training import decoding


def _nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution pick samples from, computed the plain way: softmax, sort, cut, renormalise."""
    probs = torch.softmax(logits / temperature, -1)
    p, idx = probs.sort(descending=True)
    keep = (p.cumsum(-1) - p) < top_p
    out = torch.zeros_like(probs)
    out[idx[keep]] = p[keep]
    return out / out.sum()


@pytest.mark.parametrize("vocab,top_p,spread", [(500, 0.9, 1.5), (500, 0.5, 1.0), (300, 0.95, 0.01), (200, 1.0, 2.0)])
def test_pick_draws_each_token_with_its_nucleus_probability(vocab, top_p, spread):
    """Inverting the distribution at a fine grid of uniforms gives each token its share of the grid:
    the nucleus's renormalised probability, zero outside it; with near-flat logits (``spread`` 0.01) the
    nucleus holds far more than the TOP tokens pick looks at first, and the whole-sort path serves it."""
    torch.manual_seed(0)
    logits = torch.randn(vocab) * spread
    n = 20_000
    u = (torch.arange(n, dtype=torch.float32) + 0.5) / n
    tokens = decoding.pick(logits.expand(n, vocab).contiguous(), 0.7, top_p, u)
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    want = _nucleus(logits, 0.7, top_p)
    assert (want > 0).sum() > (decoding.TOP if spread < 1 else 1)
    assert torch.all(freq[want == 0] == 0)
    assert (freq - want).abs().max() < 2.0 / n + 1e-6


def test_pick_at_temperature_zero_is_the_likeliest_token_and_rows_are_independent():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    assert decoding.pick(logits, 0.0, 0.9, torch.tensor([0.99, 0.01])).tolist() == [1, 0]
    # Each row inverts its own uniform: the same row, the same draw, whatever the other rows are.
    wide = torch.randn(3, 50)
    u = torch.tensor([0.1, 0.5, 0.9])
    together = decoding.pick(wide, 0.8, 0.9, u)
    alone = [int(decoding.pick(wide[i:i + 1], 0.8, 0.9, u[i:i + 1])) for i in range(3)]
    assert together.tolist() == alone


def _rows(trainer, texts):
    from rlfleet.shared.chat_prompt import prompt_ids

    return [prompt_ids(trainer.tokenizer, [{"role": "user", "content": t}]) for t in texts]


TEXTS = ["hi", "tell me a long story about the sea and its ships", "why?", "name three colours"]


@pytest.fixture(scope="module")
def sharp_trainer(tmp_path_factory, single_thread):
    """A tiny model whose rows prefer different tokens (the default initialisation's answers are one
    token over and over, whatever the prompt)."""
    from tinymodel import build_tiny_model

    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.training.torch_backend import Trainer

    return Trainer(resolve_model(str(build_tiny_model(tmp_path_factory.mktemp("sharp"), init_range=0.1))))


def _body_head(trainer):
    lm = trainer.base
    return lm.model, lm.lm_head.weight


def test_greedy_draws_are_transformers_greedy_answers_rows_of_any_length_ending_anywhere(sharp_trainer):
    """Left-padded rows of different lengths, rows leaving the batch as they end: each answer is
    transformers' own greedy continuation of its prompt alone, cut before its end token."""
    trainer = sharp_trainer
    rows = _rows(trainer, TEXTS)
    body, head = _body_head(trainer)
    eos, pad = trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id
    free = decoding.draw(body, head, rows, 16, 0.0, 1.0, [0] * len(rows), [eos], pad)
    # A token one answer says early and another never says, as a second end token: some rows end
    # early, others run to the cap.
    stop = next(t for t in free[0][:8] if any(t not in other for other in free[1:]))
    ends = [eos, stop]
    got = decoding.draw(body, head, rows, 16, 0.0, 1.0, [0] * len(rows), ends, pad)
    for ids, answer in zip(rows, got, strict=True):
        out = trainer.base.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones_like(torch.tensor([ids])),
                                    max_new_tokens=16, do_sample=False, eos_token_id=ends, pad_token_id=pad)
        out = out[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(out) if t in ends), len(out))
        assert answer == out[:cut]
    assert any(len(a) < 16 for a in got) and any(len(a) == 16 for a in got)  # both kinds happened


def test_each_row_draws_from_its_own_stream_whatever_batch_it_is_in(sharp_trainer):
    trainer = sharp_trainer
    rows = _rows(trainer, TEXTS)
    body, head = _body_head(trainer)
    pad, eos = trainer.tokenizer.pad_token_id, [trainer.tokenizer.eos_token_id]
    seeds = [11, 12, 13, 14]
    together = decoding.draw(body, head, rows, 12, 1.0, 0.95, seeds, eos, pad)
    alone = [decoding.draw(body, head, [r], 12, 1.0, 0.95, [s], eos, pad)[0] for r, s in zip(rows, seeds, strict=True)]
    assert together == alone
    again = decoding.draw(body, head, rows[::-1], 12, 1.0, 0.95, seeds[::-1], eos, pad)
    assert again == together[::-1]
    other = decoding.draw(body, head, rows, 12, 1.0, 0.95, [21, 22, 23, 24], eos, pad)
    assert other != together  # the seeds matter
    with pytest.raises(ValueError, match="seeds"):
        decoding.draw(body, head, rows, 4, 1.0, 1.0, [1], eos, pad)
    with pytest.raises(ValueError, match="empty prompt"):
        decoding.draw(body, head, [[]], 4, 1.0, 1.0, [1], eos, pad)


def test_the_trainer_draws_with_seeds_per_row_and_a_folded_lora_draws_what_the_lora_does(tiny_trainer):
    """The trainer's torch draws seed each row (the gate may remember the base's answers), and a bf16
    draw inside a session folds the LoRA into the bf16 weights: the logits it decodes from are the
    LoRA path's within bf16 rounding, far nearer them than the base's."""
    from rlfleet.worker.presets import preset
    from rlfleet.worker.training import torch_backend

    trainer = tiny_trainer
    trainer.draw_with("torch")
    assert trainer.rows_seeded
    convs = [[{"role": "user", "content": t}] for t in TEXTS]
    a = trainer.sample(convs, 8, seed=5, temperature=1.0, top_p=1.0)
    assert trainer.sample(convs[2:], 8, seed=0, temperature=1.0, top_p=1.0, seeds=[7, 8]) == a[2:]

    ids = torch.tensor(_rows(trainer, ["tell me a long story about the sea"]))

    def last_logits() -> torch.Tensor:
        body, head = torch_backend._decoder(trainer._active())
        with trainer._drawing():
            hidden = body(input_ids=ids).last_hidden_state[:, -1]
            return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight).float()

    base = last_logits()
    trainer._draw_bf16 = True  # the tiny model is too narrow for auto's bf16 (precision.py)
    try:
        with trainer.adapter(None, replace(preset("balanced"), rank=4), trainable=True, precision="auto"):
            torch.manual_seed(0)
            with torch.no_grad():
                for name, p in trainer._model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.5)
            folded = last_logits()
            assert torch_backend._foldable(trainer._lora)
            original = torch_backend._foldable
            torch_backend._foldable = lambda layers: False
            try:
                unfolded = last_logits()
            finally:
                torch_backend._foldable = original
            assert all(not layer.disable_adapters for layer in trainer._lora)  # switched back on
            assert all(p.dtype == torch.float32 for p in trainer.base.parameters())  # fp32 again
    finally:
        trainer._draw_bf16 = False
    effect = (unfolded - base).abs().mean()
    assert effect > 0.05
    assert (folded - unfolded).abs().mean() < 0.1 * effect


def test_a_model_decoding_cannot_run_is_drawn_by_generate_and_said_once(tiny_model_dir, single_thread, monkeypatch,
                                                                        caplog):
    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.training.torch_backend import Trainer

    trainer = Trainer(resolve_model(str(tiny_model_dir)))
    trainer.draw_with("torch")
    calls = []

    def refuses(*args, **kwargs):
        calls.append(1)
        raise TypeError("forward() got an unexpected keyword argument 'position_ids'")

    monkeypatch.setattr(decoding, "draw", refuses)
    convs = [[{"role": "user", "content": t}] for t in TEXTS]
    assert trainer.rows_seeded
    with caplog.at_level("WARNING"):
        first = trainer.sample(convs, 6, seed=3, temperature=1.0)
        second = trainer.sample(convs, 6, seed=3, temperature=1.0)
    assert len(first) == len(convs) and all(0 < len(a) <= 6 for a in first)
    assert second == first  # generate's one stream from the seed
    assert len(calls) == 1 and not trainer.rows_seeded  # tried once; the gate no longer remembers answers
    assert sum("cannot draw with rlfleet's decoding" in r.message for r in caplog.records) == 1
