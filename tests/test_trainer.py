"""Encoding, batching and training runs on the tiny offline model (tests/tinymodel.py, built once per
session by the ``tiny_model_dir`` fixture in conftest.py)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.worker.batching import (
    Encoded,
    collate,
    encode_sample,
    ended_as_recorded,
    fold_hosts,
    micro_batches,
    shared_prefix,
)
from rlfleet.worker.gate import GateConfig
from rlfleet.worker.presets import TrainConfig, preset
from rlfleet.worker.samples import BASE, Progress, RunResult, TrainSample
from rlfleet.worker.training.torch_backend import Trainer

GOOD, BAD = "yes yes yes yes", "no no no no"
TEMPLATES = ["Tell me about {}.", "What is {}?", "Describe {} briefly.", "Do you like {}?"]
TRAIN_TOPICS = [
    "cats", "dogs", "rain", "tea", "maps", "jazz", "bread", "snow",
    "chess", "kites", "ships", "moss", "owls", "rust", "silk", "wolves",
]  # fmt: skip
HELD_OUT = ["clocks", "bees", "pears", "tides", "figs", "lamps"]
# The tiny model needs a far larger step than a real one to show a preference in a few steps, and a
# wide sequence band (the presets' bands drop most sequences after the first step: see the report).
# The fading 👎 (neg_fade) stops a 👎's push a few hundredths of a nat per token below the base: at this
# step size the tiny model's disliked answers would fall only about that far, and these tests measure
# the push itself (tests/test_training_loop.py measures the fade).
LEARN = replace(preset("balanced"), lr=3e-3, steps=8, seq_band=(0.5, 2.0), neg_fade=0.0)


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def held_out_shifts(model, adapter) -> tuple[float, float]:
    """How much ``adapter`` moved the mean log-prob of the good and of the bad answer on held-out
    prompts (the base: adapter None). ``model`` is any trainer with ``mean_logprobs``."""
    good = [(chat(TEMPLATES[i % 4].format(t)), GOOD) for i, t in enumerate(HELD_OUT)]
    bad = [(chat(TEMPLATES[i % 4].format(t)), BAD) for i, t in enumerate(HELD_OUT)]

    def mean(pairs, which):
        values = model.mean_logprobs(pairs, which)
        return sum(values) / len(values)

    return mean(good, adapter) - mean(good, None), mean(bad, adapter) - mean(bad, None)


@pytest.fixture(scope="module")
def trainer(tiny_trainer) -> Trainer:
    return tiny_trainer


@pytest.fixture(scope="module")
def tok(trainer):
    return trainer.tokenizer


def prompt_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def probe_ids(tok) -> torch.Tensor:
    return torch.tensor([prompt_ids(tok, chat("probe")) + [70, 71, 72]])


def base_logits(trainer: Trainer) -> torch.Tensor:
    with torch.no_grad():
        return trainer.base(input_ids=probe_ids(trainer.tokenizer)).logits.clone()


def assert_adapter_acts_and_unloads(trainer: Trainer, adapter, before: torch.Tensor) -> None:
    """``adapter`` loaded on ``trainer``'s base changes the probe's logits (``before``: the base's own),
    and unloading it leaves the base as it was."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(trainer.base, str(adapter))
    try:
        with torch.no_grad():
            assert not torch.allclose(model(input_ids=probe_ids(trainer.tokenizer)).logits, before)
    finally:
        model.unload()
    assert torch.equal(base_logits(trainer), before)


# -- encoding and batching --------------------------------------------------------------------


def test_encode_sample_masks_exactly_response_and_end_token(tok):
    s = TrainSample(1, chat("hi there"), "fine, thanks", 1.0)
    enc = encode_sample(tok, s, max_tokens=1024)
    body = tok("fine, thanks", add_special_tokens=False)["input_ids"]
    assert enc.input_ids[: enc.prompt_len] == prompt_ids(tok, s.prompt)
    assert enc.input_ids[enc.prompt_len :] == body + [tok.eos_token_id]
    assert enc.response_mask == [0] * enc.prompt_len + [1] * (len(body) + 1)
    assert enc.behaviour_logprobs is None

    short = encode_sample(tok, TrainSample(2, chat("x"), "ok", 1.0), 1024)
    batch = collate([enc, short], tok.pad_token_id)
    row = 1  # the short one is right-padded
    assert batch["input_ids"][row, short.length :].eq(tok.pad_token_id).all()
    assert batch["attention_mask"][row].sum().item() == short.length
    assert batch["response_mask"][row].tolist() == short.response_mask + [0] * (enc.length - short.length)


def test_an_answer_cut_off_at_a_cap_trains_without_an_end_token(tok):
    cut = encode_sample(tok, TrainSample(None, chat("hi there"), "fine, thanks", 0.0, complete=False), 1024)
    whole = encode_sample(tok, TrainSample(None, chat("hi there"), "fine, thanks", 0.0), 1024)
    assert cut.input_ids == whole.input_ids[:-1] and whole.input_ids[-1] == tok.eos_token_id
    assert cut.response_mask == whole.response_mask[:-1]


def test_a_rated_answer_whose_recorded_tokens_stop_short_of_an_end_token_was_cut_off(tok):
    body = tok("fine, thanks", add_special_tokens=False)["input_ids"]

    def rated(ids):
        return TrainSample(1, chat("hi there"), "fine, thanks", 1.0, behaviour_token_ids=ids,
                           behaviour_logprobs=None if ids is None else [-0.1] * len(ids))

    assert ended_as_recorded(rated(body + [tok.eos_token_id]), tok).complete  # the model ended it
    assert ended_as_recorded(rated(None), tok).complete  # another model's answer: nothing says otherwise
    cut = ended_as_recorded(rated(body), tok)  # the cap fell after its last token
    assert not cut.complete and not ended_as_recorded(cut, tok).complete
    enc = encode_sample(tok, cut, 1024)
    assert enc.input_ids[enc.prompt_len:] == body and enc.behaviour_logprobs == [-0.1] * len(body)


def test_a_run_counts_the_rated_answers_a_cap_cut_off(trainer, tmp_path):
    tok = trainer.tokenizer
    samples = preference_samples()[:4]
    ids = [tok(s.response, add_special_tokens=False)["input_ids"] for s in samples]
    recorded = [replace(s, behaviour_token_ids=i + ([tok.eos_token_id] if k % 2 else [])) for k, (s, i)
                in enumerate(zip(samples, ids, strict=True))]
    m = trainer.run(recorded, None, replace(LEARN, steps=1), None, tmp_path / "a").metrics
    assert m["ratings_cut"] == 2
    assert trainer.run(samples, None, replace(LEARN, steps=1), None, tmp_path / "b").metrics["ratings_cut"] == 0


def test_stored_behaviour_used_only_for_matching_tokens(tok):
    body = tok("sure", add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id

    def enc(ids, lps):
        s = TrainSample(1, chat("q"), "sure", 1.0, behaviour_logprobs=lps, behaviour_token_ids=ids)
        return encode_sample(tok, s, 1024)

    full = [-0.1 * (i + 1) for i in range(len(body) + 1)]
    assert enc(body + [eos], full).behaviour_logprobs == full
    assert enc(body, full[:-1]).behaviour_logprobs == full[:-1]  # end token not recorded: a prefix
    assert enc([b + 1 for b in body], full[:-1]).behaviour_logprobs is None  # other tokens
    assert enc(body + [eos], full[:-1]).behaviour_logprobs is None  # lengths disagree


def test_truncation_keeps_the_answer_and_the_prompt_tail(tok):
    long_prompt = chat("word " * 200)
    s = TrainSample(1, long_prompt, "short answer", 1.0)
    enc = encode_sample(tok, s, max_tokens=64)
    full_prompt = prompt_ids(tok, long_prompt)
    assert enc.length == 64
    assert enc.input_ids[: enc.prompt_len] == full_prompt[-enc.prompt_len :]  # generation prompt kept
    assert enc.n_response == len("short answer") + 1

    body = tok("z" * 100, add_special_tokens=False)["input_ids"]
    s = TrainSample(2, chat("q"), "z" * 100, 1.0, behaviour_logprobs=[-1.0] * 100, behaviour_token_ids=body)
    enc = encode_sample(tok, s, max_tokens=32)
    assert (enc.length, enc.prompt_len, enc.n_response) == (32, 1, 31)
    assert enc.behaviour_logprobs == [-1.0] * 31


def test_micro_batches_respect_the_token_budget():
    rng = random.Random(0)
    lengths = [rng.randint(5, 120) for _ in range(60)] + [300]
    encoded = [Encoded(input_ids=[1] * n, prompt_len=1) for n in lengths]
    batches = micro_batches(encoded, 256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= 256 or len(b) == 1
    assert [lengths[i] for b in batches for i in b] == sorted(lengths)  # bucketed by length
    assert len(batches) < len(lengths) // 2  # and actually packed


def test_token_logprobs_match_a_full_forward(trainer):
    tok = trainer.tokenizer
    pairs = [(chat("Tell me about owls."), "hoot hoot"), (chat("x"), "a much longer answer, padded less")]
    fast = trainer.token_logprobs(pairs)
    for (prompt, response), got in zip(pairs, fast, strict=True):
        p = prompt_ids(tok, prompt)
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = trainer.base(input_ids=torch.tensor([p + r])).logits[0]
        want = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert got == pytest.approx(want.tolist(), abs=1e-5)
    # A config that post-processes logits forces the full-logits path (Llama ignores the field, so
    # both paths must agree).
    trainer.base.config.final_logit_softcapping = 30.0
    try:
        slow = trainer.token_logprobs(pairs)
    finally:
        del trainer.base.config.final_logit_softcapping
    for a, b in zip(fast, slow, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_a_shared_prompt_is_counted_once_in_the_token_budget():
    system = list(range(100, 140))  # 40 tokens every sample begins with (a system prompt)
    encoded = [Encoded(input_ids=system + [7 + i, 8, 9] + [5] * (4 + i % 3), prompt_len=43) for i in range(12)]
    plain = micro_batches(encoded, 200)
    shared = micro_batches(encoded, 200, share_prefix=True)
    assert sorted(i for b in shared for i in b) == list(range(12))
    assert len(shared) < len(plain)  # 40 + 12 * ~9 fits where 12 * ~49 does not
    for b in shared:
        longest = max(encoded[i].length for i in b)
        assert shared_prefix([encoded[i] for i in b]) + len(b) * (longest - 40) <= 200 or len(b) == 1
    # a prefix stops before the first response token's context: its hidden state is computed per row
    short = [Encoded(input_ids=system + [1, 2], prompt_len=20), Encoded(input_ids=system + [3, 4], prompt_len=30)]
    assert shared_prefix(short) == 19
    assert shared_prefix([Encoded(input_ids=[1] * 10 + [2], prompt_len=10)] * 2) == 0  # under the minimum


def test_a_batch_sharing_its_prompt_gets_the_same_logprobs_and_gradients(trainer, tok, monkeypatch):
    """The shared prefix runs once and its keys and values serve every row: the log-probs and the
    gradient of the LoRA weights are those of a full pass per row."""
    system = {"role": "system", "content": "You are a terse assistant for a game of cards; answer in a word."}
    samples = [TrainSample(i, [system, *chat(f"Card {t}?")], r, 1.0)
               for i, (t, r) in enumerate([("ace", "hit"), ("two", "stay now"), ("king", "hit me please")])]
    encoded = [encode_sample(tok, s, 256) for s in samples]
    groups, batches = trainer.batches(encoded, 4096)
    assert len(groups) == 1
    batch = batches[0]
    assert int(batch["shared_prefix"]) >= 16

    def pass_(share: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if not share:
            monkeypatch.setattr(trainer, "_share_prefix", False)
        torch.manual_seed(0)
        with trainer.adapter(None, LEARN, trainable=True) as model:
            for name, p in model.named_parameters():
                if "lora_B" in name:  # a LoRA that is not the base, so the prefix's keys depend on it
                    p.data.normal_(0, 0.05)
            params = [p for p in model.parameters() if p.requires_grad]
            lp = trainer._logprobs(batch)
            (lp * batch["response_mask"]).sum().backward()
            grad = torch.cat([p.grad.flatten() for p in params])
        monkeypatch.undo()
        return lp.detach(), grad

    shared_lp, shared_grad = pass_(True)
    full_lp, full_grad = pass_(False)
    assert torch.allclose(shared_lp, full_lp, atol=1e-5)
    assert float(full_grad.norm()) > 0
    assert float((shared_grad - full_grad).norm() / full_grad.norm()) < 1e-4


def test_a_row_that_is_another_rows_beginning_and_an_end_token_is_read_from_its_pass():
    answer = Encoded(input_ids=[1, 2, 3, 4, 5, 6, 9], prompt_len=3)
    ended = [Encoded(input_ids=[1, 2, 3, 4, 9], prompt_len=3), Encoded(input_ids=[1, 2, 3, 4, 5, 9], prompt_len=3)]
    other = Encoded(input_ids=[1, 2, 7, 8, 9], prompt_len=3)
    twin = Encoded(input_ids=[1, 2, 7, 8, 9], prompt_len=3)  # the same row twice: the earlier one runs
    same_length = Encoded(input_ids=[1, 2, 7, 8, 4], prompt_len=3)  # differs only in its last token
    assert fold_hosts([ended[0], answer, ended[1], other, twin, same_length]) == [1, 1, 1, 3, 3, 3]
    # a row's host is the longest that begins with all its tokens but the last; a host runs itself
    longer = Encoded(input_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9], prompt_len=3)
    assert fold_hosts([answer, ended[0], longer]) == [2, 2, 2]
    # one shorter than the row, or different before its last token, does not host it
    assert fold_hosts([Encoded(input_ids=[1, 2, 3], prompt_len=2), Encoded(input_ids=[1, 2, 3, 4], prompt_len=2),
                       Encoded(input_ids=[1, 5, 3, 4, 6], prompt_len=2)]) == [1, 1, 2]
    assert fold_hosts([]) == []


def test_a_folded_row_rides_in_its_hosts_micro_batch_and_costs_it_nothing():
    answers = [Encoded(input_ids=[50 + i] * 30 + [9], prompt_len=10) for i in range(4)]
    ends = [Encoded(input_ids=[50 + i] * k + [9], prompt_len=10) for i in range(4) for k in (12, 20)]
    encoded = answers + ends
    hosts = fold_hosts(encoded)
    assert hosts == [0, 1, 2, 3] + [i for i in range(4) for _ in (12, 20)]
    batches = micro_batches(encoded, 62, hosts=hosts)  # two 31-token hosts a batch; their endings ride free
    assert sorted(i for b in batches for i in b) == list(range(12))
    assert len(batches) == 2
    for b in batches:
        assert {hosts[i] for i in b} <= set(b)
    assert len(micro_batches(encoded, 62)) > 2  # unfolded, the endings take batches of their own


def test_rows_read_from_their_hosts_pass_get_their_own_logprobs_and_gradients(trainer, tok):
    """An explored answer and its earlier endings (its first tokens, then the end token) run as one
    row: each ending's log-probs, its top tokens and the gradient through all of them are those of a
    pass over every row whole."""
    eos = tok.eos_token_id
    answer = encode_sample(tok, TrainSample(None, chat("Card ace?"), "Hit me. Then stay. Then go home now.", 0.0), 256)
    other = encode_sample(tok, TrainSample(None, chat("Card two?"), "Stay.", 0.0), 256)
    ends = [Encoded(input_ids=answer.input_ids[:answer.prompt_len + k] + [eos], prompt_len=answer.prompt_len)
            for k in (3, 6)]
    encoded = [answer, *ends, other]
    groups, batches = trainer.batches(encoded, 4096)
    assert len(groups) == 1
    folded = batches[0]
    assert folded["run_rows"].tolist() == sorted(groups[0].index(i) for i in (0, 3))
    whole = {k: v for k, v in folded.items() if k not in ("run_rows", "row_host")}

    def pass_(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        with trainer.adapter(None, LEARN, trainable=True) as model:
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.data.normal_(0, 0.05)
            params = [p for p in model.parameters() if p.requires_grad]
            top = trainer.reference_logprobs(batch, top_k=4)[1].top[1]
            lp = trainer._logprobs(batch)
            (lp * batch["response_mask"]).sum().backward()
            grad = torch.cat([p.grad.flatten() for p in params])
        return lp.detach(), top, grad

    got_lp, got_top, got_grad = pass_(folded)
    want_lp, want_top, want_grad = pass_(whole)
    assert torch.allclose(got_lp, want_lp, atol=1e-5)
    assert torch.allclose(got_top, want_top, atol=1e-5)
    # the endings' end tokens are their own (not the answer's next token): the rows differ there
    rows = [groups[0].index(i) for i in (0, 1)]
    end = answer.prompt_len + 3
    assert float(got_lp[rows[1], end]) != pytest.approx(float(got_lp[rows[0], end]), abs=1e-3)
    assert float(want_grad.norm()) > 0
    assert float((got_grad - want_grad).norm() / want_grad.norm()) < 1e-4


def test_a_model_that_takes_no_shared_cache_trains_each_row_whole(trainer, tok, monkeypatch, caplog):
    import rlfleet.worker.training.torch_backend as backend

    system = {"role": "system", "content": "You are a terse assistant for a game of cards; answer in a word."}
    encoded = [encode_sample(tok, TrainSample(i, [system, *chat(q)], "hit", 1.0), 256)
               for i, q in enumerate(["Card ace?", "Card two?"])]
    _, batches = trainer.batches(encoded, 4096)
    with torch.no_grad():
        want = trainer._logprobs(batches[0])
    real = backend._forward

    def no_cache(model, ids, attn, prefix):
        if prefix:
            raise TypeError("forward() got an unexpected keyword argument 'cache'")
        return real(model, ids, attn, prefix)

    monkeypatch.setattr(backend, "_forward", no_cache)
    try:
        with torch.no_grad(), caplog.at_level("WARNING"):
            got = trainer._logprobs(batches[0])
            again = trainer._logprobs(batches[0])
        assert torch.allclose(got, want, atol=1e-5) and torch.allclose(again, want, atol=1e-5)
        assert caplog.text.count("cannot share a prompt's keys and values") == 1  # said once, then not tried
    finally:
        trainer._share_prefix = True


def test_the_gates_sums_are_those_of_a_full_pass_per_answer(trainer, tok):
    """score_rows reads only the answer positions (a shared prompt once): its per-answer sums of token
    log-prob, entropy and KL to the base are what a plain forward of each answer alone gives."""
    system = {"role": "system", "content": "You are a terse assistant for a game of cards; answer in a word."}
    samples = [TrainSample(i, [system, *chat(q)], r, 0.0)
               for i, (q, r) in enumerate([("Card ace?", "hit"), ("Card two?", "stay now"), ("Go?", "go go")])]
    encoded = [encode_sample(tok, s, 256) for s in samples]
    groups, batches = trainer.batches(encoded, 4096)
    torch.manual_seed(1)
    with trainer.adapter(None, LEARN, trainable=True) as model:
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
        got = trainer.score_rows(batches[0], with_kl=True)
        for i, row in zip(groups[0], got, strict=True):
            e = encoded[i]
            ids = torch.tensor([e.input_ids])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0, e.prompt_len - 1 : -1], -1)
                with model.disable_adapter():
                    ref = torch.log_softmax(model(input_ids=ids).logits[0, e.prompt_len - 1 : -1], -1)
            target = torch.tensor(e.input_ids[e.prompt_len :])
            for sums, want in ((row.model, lp), (row.base, ref)):  # the base's from the KL's pass of it
                assert sums.tokens == e.n_response
                assert sums.logprob == pytest.approx(float(want.gather(-1, target[:, None]).sum()), abs=1e-4)
                assert sums.entropy == pytest.approx(float(-(want.exp() * want).sum()), abs=1e-4)
            assert row.model.kl == pytest.approx(float((lp.exp() * (lp - ref)).sum()), abs=1e-4)
            assert row.model.kl > 1e-4  # the adapter is not the base: the KL is measured, not 0
            assert row.base.kl == 0.0 and row.base.logprob != row.model.logprob


# -- training runs ----------------------------------------------------------------------------


def preference_samples() -> list[TrainSample]:
    samples = []
    for i, topic in enumerate(TRAIN_TOPICS):
        p = chat(TEMPLATES[i % len(TEMPLATES)].format(topic))
        samples.append(TrainSample(2 * i, p, GOOD, 1.0))
        samples.append(TrainSample(2 * i + 1, p, BAD, -1.0))
    return samples


def learning_run(trainer, folder: Path, cfg: TrainConfig = LEARN) -> tuple[Path, RunResult, list[Progress]]:
    """A run of ``cfg`` over every preference sample into ``folder``/v0001: the adapter's folder, the
    result, and the progress the run reported."""
    out = folder / "v0001"
    seen: list[Progress] = []
    result = trainer.run(preference_samples(), None, cfg, None, out, progress=seen.append)
    return out, result, seen


@pytest.fixture(scope="module")
def learned(trainer, tmp_path_factory):
    """One learning run shared by the tests that inspect it."""
    return learning_run(trainer, tmp_path_factory.mktemp("runs"))


def test_run_writes_a_loadable_adapter_and_leaves_the_base_clean(trainer, learned, tmp_path):
    from safetensors.torch import load_file

    out, result, seen = learned
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "meta.json").exists()  # the caller writes it
    for key in (
        "ratings_used", "retractions", "mean_advantage", "loss", "mean_kl", "accepted_token_frac",
        "accepted_seq_frac", "tokens_per_s", "seconds", "steps", "lr", "n_tokens",
    ):  # fmt: skip
        assert key in result.metrics, key
    assert result.metrics["ratings_used"] == 32 and result.metrics["steps"] == LEARN.steps
    assert result.promoted_ok and result.reason is None
    # ema None: the neutral baseline 0, so +1 -> 1.2 and -1 -> -1; then the class weights (16 liked,
    # 16 disliked) bring the 👎s' total up to the 👍s': -1.2.
    assert result.advantages[0] == pytest.approx(1.2) and result.advantages[1] == pytest.approx(-1.2)
    assert result.metrics["class_weight"] == pytest.approx(1.2)
    assert [p.phase for p in seen][0] == "reference"
    assert [p.step for p in seen if p.phase == "training"] == list(range(0, LEARN.steps + 1))  # 0: steps begin

    before = base_logits(trainer)
    assert not any("lora" in name for name, _ in trainer.base.named_modules())
    assert_adapter_acts_and_unloads(trainer, out, before)

    # A second run starts from the clean base: same seed and data give the same adapter exactly.
    small = preference_samples()[:4]
    cfg = replace(LEARN, steps=2)
    trainer.run(small, None, cfg, None, tmp_path / "a")
    trainer.run(small, None, cfg, None, tmp_path / "b")
    wa, wb = (
        load_file(tmp_path / "a" / "adapter_model.safetensors"),
        load_file(tmp_path / "b" / "adapter_model.safetensors"),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert torch.equal(base_logits(trainer), before)


def test_learning_moves_held_out_preferences(trainer, learned):
    out, result, _ = learned
    good_shift, bad_shift = held_out_shifts(trainer, out)
    assert good_shift > 0.2, (good_shift, result.metrics)
    assert bad_shift < -0.2, (bad_shift, result.metrics)
    assert result.metrics["accepted_seq_frac"] > 0.5
    assert 0 < result.metrics["mean_kl"] < LEARN.max_mean_kl
    # sequence_logprobs is the single-pair form of the same measurement.
    first = (chat(TEMPLATES[0].format(HELD_OUT[0])), GOOD)
    assert trainer.sequence_logprobs(first[0], GOOD, out) == pytest.approx(trainer.mean_logprobs([first], out)[0])


def test_first_step_accepts_every_sequence_even_in_the_narrowest_band(trainer, tmp_path):
    # Reference, behaviour and the trained policy go through the same fp32 path, so before any
    # update every ratio is exactly 1: a narrow band can only drop what training moved.
    cfg = replace(preset("careful"), steps=1)
    result = trainer.run(preference_samples()[:8], None, cfg, None, tmp_path / "a")
    assert result.metrics["accepted_seq_frac"] == 1.0
    assert result.metrics["accepted_token_frac"] == 1.0
    assert result.metrics["mean_kl"] == 0.0


def check_stored_behaviour_is_used(trainer, out) -> None:
    """A sample's stored behaviour log-probs set the ratios of ``trainer``'s first step (each run saves
    to ``out``), and only for the tokens they were recorded for."""
    tok = trainer.tokenizer
    ids = tok(GOOD, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    p = chat("Tell me about cats.")
    true = trainer.token_logprobs([(p, GOOD)])[0]
    assert len(true) == len(ids)
    cfg = replace(preset("careful"), steps=1)

    def first_step(lps, token_ids):
        s = TrainSample(1, p, GOOD, 1.0, behaviour_logprobs=lps, behaviour_token_ids=token_ids)
        return trainer.run([s], None, cfg, None, out).metrics

    # Recorded exactly as the trainer computes them: every ratio is 1, even the careful band keeps it.
    assert first_step(true, ids)["accepted_seq_frac"] == 1.0
    # Recorded one nat low: every ratio is e = 2.7, outside the token band [0.5, 2].
    shifted = first_step([x - 1.0 for x in true], ids)
    assert shifted["accepted_token_frac"] == 0.0 and shifted["accepted_seq_frac"] == 0.0
    # The same values for other tokens are ignored: the run-start policy is the behaviour.
    assert first_step([x - 1.0 for x in true], [i + 1 for i in ids])["accepted_token_frac"] == 1.0


def test_stored_behaviour_logprobs_are_used(trainer, tmp_path):
    check_stored_behaviour_is_used(trainer, tmp_path / "a")


def test_retraction_keeps_its_fixed_advantage(trainer, tmp_path):
    samples = preference_samples()[:3] + [TrainSample(99, chat("old"), GOOD, 1.0, fixed_advantage=-0.7)]
    result = trainer.run(samples, 0.5, replace(LEARN, steps=1), None, tmp_path / "a")
    assert result.advantages[99] == pytest.approx(-0.7)
    # (1 - 0.5) * 1.2 = 0.6 each, then the class weights: two 👍s at 0.6 against one 👎 at -1.5, times
    # 1.25; the retraction is not rated in this run and keeps its own.
    assert result.advantages[0] == pytest.approx(0.75) and result.advantages[2] == pytest.approx(0.75)
    assert result.advantages[1] == pytest.approx(-1.5)
    assert (result.metrics["ratings_used"], result.metrics["retractions"]) == (3, 1)


def check_still_at_parent(trainer, parent, out) -> None:
    """One step of ``trainer`` from the ``parent`` adapter into ``out`` that keeps its weights and starts
    at the parent: lr 0 keeps the weights; a band of +-1e-5 keeps a sequence only if the run-start policy
    equals the behaviour policy, i.e. the parent's weights were loaded before the behaviour pass."""
    cfg: TrainConfig = replace(LEARN, lr=0.0, steps=1, seq_band=(1 - 1e-5, 1 + 1e-5))
    result = trainer.run(preference_samples()[:8], None, cfg, parent, out)
    assert result.metrics["accepted_seq_frac"] == 1.0
    assert result.metrics["mean_kl"] > 1e-3  # the run started away from the base: at the parent


def check_replayed_behaviour_is_the_start_policy(trainer, parent, out) -> None:
    """Replayed samples carry log-probs an older version recorded (here a nat below the parent's); the
    run from ``parent`` sets them aside and takes the parent, computed once at the start, as their
    behaviour: with lr 0 and a band of +-1e-5 every sequence stays, while the same samples as fresh
    ratings are judged by what they recorded and dropped (a ratio of e, outside both bands).

    So are fresh ratings of answers the parent itself drew (``answered_by`` its version): the run-start
    pass is their behaviour exactly, whatever was recorded (llama.cpp's values are near, not equal);
    an answer another version drew keeps what it recorded."""
    tok = trainer.tokenizer
    cfg: TrainConfig = replace(LEARN, lr=0.0, steps=1, seq_band=(1 - 1e-5, 1 + 1e-5))
    recorded = []
    for s in preference_samples()[:6]:
        ids = tok(s.response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        older = [x - 1.0 for x in trainer.token_logprobs([(s.prompt, s.response)], parent)[0]]
        recorded.append(replace(s, behaviour_logprobs=older, behaviour_token_ids=ids))
    replayed = trainer.run([replace(s, replayed=True) for s in recorded], None, cfg, parent, out / "a").metrics
    assert (replayed["accepted_seq_frac"], replayed["accepted_token_frac"]) == (1.0, 1.0)
    assert replayed["mean_kl"] > 1e-3  # the behaviour is the parent, not the base
    assert (replayed["replayed"], replayed["ratings_used"]) == (6, 0)
    fresh = trainer.run(recorded, None, cfg, parent, out / "b").metrics
    assert (fresh["accepted_seq_frac"], fresh["replayed"], fresh["ratings_used"]) == (0.0, 0, 6)
    by_parent = [replace(s, answered_by=Path(parent).name) for s in recorded]
    own = trainer.run(by_parent, None, cfg, parent, out / "c").metrics
    assert (own["accepted_seq_frac"], own["accepted_token_frac"], own["ratings_used"]) == (1.0, 1.0, 6)
    assert own["mean_kl"] > 1e-3  # the behaviour is the parent, not the base
    other = trainer.run([replace(s, answered_by="v9999") for s in recorded], None, cfg, parent, out / "d").metrics
    assert other["accepted_seq_frac"] == 0.0
    # From a fresh adapter the run starts at the base: what the base drew is recomputed, and so kept.
    base = trainer.run([replace(s, answered_by=BASE) for s in recorded], None, cfg, None, out / "e").metrics
    assert base["accepted_seq_frac"] == 1.0


def check_anchor_reference_is_the_base(trainer, parent, out) -> None:
    """The top-k KL anchor's reference is the base with the adapter switched off (a reference pass
    that silently kept the adapter on would make the anchor 0). Continuing ``parent`` with lr 0 and
    K above the vocabulary, the anchor's KL before the first update is the exact KL of the parent to
    the base that the gate measures on the same answers; the base itself (no parent) starts at 0."""
    samples = preference_samples()[:8]
    cfg: TrainConfig = replace(LEARN, lr=0.0, steps=1, kl_top_k=1024)
    assert len(trainer.tokenizer) <= cfg.kl_top_k
    from_parent = trainer.run(samples, None, cfg, parent, out / "a").metrics
    exact = trainer.score_model([(s.prompt, s.response) for s in samples], parent, GateConfig(eval_samples=0)).kl
    assert exact > 1e-3
    assert from_parent["anchor_kl_start"] == pytest.approx(exact, rel=1e-3)
    from_base = trainer.run(samples, None, cfg, None, out / "b").metrics
    assert from_base["anchor_kl_start"] == pytest.approx(0.0, abs=1e-6)


def test_anchor_reference_is_the_base(trainer, learned, tmp_path):
    parent, _, _ = learned
    check_anchor_reference_is_the_base(trainer, parent, tmp_path)


def test_the_top_k_anchor_holds_the_next_token_distribution_near_the_base(trainer, tmp_path):
    check_top_k_anchor_holds_near_the_base(trainer, tmp_path)


def check_top_k_anchor_holds_near_the_base(trainer, folder: Path) -> None:
    """With the top-k anchor weighted in, the trained policy's exact KL to the base on the rated
    answers stays well below the same run's without any anchor, and it still learns the rated
    direction (a wrong or zero anchor gradient fails the first; an anchor that swamps the policy
    term, the second)."""
    samples = preference_samples()
    pairs = [(s.prompt, s.response) for s in samples]
    exact = {}
    for beta in (0.0, 50.0):
        out = folder / f"beta{beta}"
        trainer.run(samples, None, replace(LEARN, beta=beta, kl_top_k=1024), None, out)
        exact[beta] = trainer.score_model(pairs, out, GateConfig(eval_samples=0)).kl
        good_shift, bad_shift = held_out_shifts(trainer, out)
        assert good_shift > 0.05 and bad_shift < -0.05, (beta, good_shift, bad_shift)
    assert exact[50.0] < 0.5 * exact[0.0], exact


def test_the_entropy_hinge_compares_with_the_base_and_holds_the_entropy_down(trainer, learned, tmp_path):
    parent, _, _ = learned
    check_entropy_hinge(trainer, parent, tmp_path)


def check_entropy_hinge(trainer, parent, folder: Path) -> None:
    """The entropy hinge's reference is the base with the adapter off: before the first update it is
    0 from a fresh adapter (which is the base) and, continuing ``parent``, at least the parent's rise
    in mean entropy over the base's (a mean of hinges is at least the hinge of the mean) and above 0
    (a reference pass that kept the adapter on would read 0). Weighted in, the run ends with a lower
    next-token entropy on its rated answers than the same run without it, and still learns."""
    samples = preference_samples()
    pairs = [(s.prompt, s.response) for s in samples]
    measured = GateConfig(eval_samples=0)
    still = replace(LEARN, lr=0.0, steps=1, entropy_hinge=1.0)
    assert trainer.run(samples[:8], None, still, None, folder / "a").metrics["entropy_excess_start"] == pytest.approx(
        0.0, abs=1e-6)
    from_parent = trainer.run(samples[:8], None, still, parent, folder / "b").metrics["entropy_excess_start"]
    top8 = [(s.prompt, s.response) for s in samples[:8]]
    rise = trainer.score_model(top8, parent, measured).entropy - trainer.score_model(top8, None, measured).entropy
    assert from_parent > 0 and from_parent >= max(rise, 0.0) - 1e-5, (from_parent, rise)

    entropy = {}
    for weight in (0.0, 10.0):
        out = folder / f"w{weight}"
        trainer.run(samples, None, replace(LEARN, entropy_hinge=weight), None, out)
        entropy[weight] = trainer.score_model(pairs, out, measured).entropy
        good_shift, bad_shift = held_out_shifts(trainer, out)
        assert good_shift > 0.05 and bad_shift < -0.05, (weight, good_shift, bad_shift)
    assert entropy[10.0] < entropy[0.0], entropy


def test_the_halfway_adapter_is_the_run_after_half_its_steps(trainer, tmp_path):
    check_halfway_adapter_is_the_half_run(trainer, tmp_path)


def check_halfway_adapter_is_the_half_run(trainer, folder: Path) -> None:
    """A run asked for its halfway adapter saves, beside its own, exactly what a run of half the
    steps trains (same seed, same samples): the version the gate falls back on is that smaller step,
    not a copy of the full run or of the start."""
    from safetensors.numpy import load_file

    samples = preference_samples()
    cfg = replace(LEARN, steps=4)
    trainer.run(samples, None, cfg, None, folder / "full", halfway_dir=folder / "halfway")
    trainer.run(samples, None, replace(cfg, steps=2), None, folder / "half")
    weights = {name: load_file(folder / name / "adapter_model.safetensors") for name in ("full", "halfway", "half")}
    half, halfway, full = weights["half"], weights["halfway"], weights["full"]
    assert half.keys() == halfway.keys() == full.keys()
    assert all(np.allclose(halfway[k], half[k], rtol=1e-5, atol=1e-7) for k in half)
    assert not all(np.allclose(halfway[k], full[k], rtol=1e-3, atol=1e-6) for k in half)
    # ... and it acts: its held-out shift lies on the way to the full run's, in the rated direction.
    g_half, b_half = held_out_shifts(trainer, folder / "halfway")
    g_full, b_full = held_out_shifts(trainer, folder / "full")
    assert 0 < g_half < g_full and b_full < b_half < 0, (g_half, g_full, b_half, b_full)


def test_replayed_samples_start_from_the_parent_as_their_behaviour(trainer, learned, tmp_path):
    parent, _, _ = learned
    check_replayed_behaviour_is_the_start_policy(trainer, parent, tmp_path)


def test_a_run_with_replayed_samples_learns_and_saves_a_loadable_adapter(trainer, tmp_path):
    # Half of the run replayed, as a run after the first mixes them in: it learns from both halves.
    samples = preference_samples()
    mixed = samples[:16] + [replace(s, replayed=True) for s in samples[16:]]
    out = tmp_path / "v0002"
    result = trainer.run(mixed, None, LEARN, None, out)
    assert result.promoted_ok and (result.metrics["ratings_used"], result.metrics["replayed"]) == (16, 16)
    assert set(result.advantages) == {s.rating_id for s in mixed}  # the caller decides what is consumed
    good_shift, bad_shift = held_out_shifts(trainer, out)
    assert good_shift > 0.2 and bad_shift < -0.2, result.metrics
    assert_adapter_acts_and_unloads(trainer, out, base_logits(trainer))


def test_parent_adapter_is_continued(trainer, learned, tmp_path):
    from safetensors.torch import load_file

    parent, _, _ = learned
    check_still_at_parent(trainer, parent, tmp_path / "v2")
    w1 = load_file(parent / "adapter_model.safetensors")
    w2 = load_file(tmp_path / "v2" / "adapter_model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    p = chat("Describe clocks briefly.")
    assert trainer.sequence_logprobs(p, GOOD, tmp_path / "v2") == pytest.approx(
        trainer.sequence_logprobs(p, GOOD, parent)
    )
