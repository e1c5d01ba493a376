"""The first optimizer step's forward pass stands in for the run-start pass, and for a fresh LoRA the
reference pass, on the micro-batches that step trains (worker/training/policy_gradient.py, FromStep):
before its update the policy is the run-start policy, in the same batch and numerics. A run then
makes fewer forward passes and ends with the same adapter and the same figures as one that runs
every pass before its first step, its ratios at the start exactly 1 where a separate pass put them
within rounding of 1 (a pass that builds autograd's graph and one that does not round differently)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from safetensors.torch import load_file

from rlfleet.shared.registry import ADAPTER_WEIGHTS
from rlfleet.worker.batching import encode_sample
from rlfleet.worker.presets import preset
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training.loop import RunData
from rlfleet.worker.training.policy_gradient import PolicyGradient
from rlfleet.worker.training.torch_backend import Trainer

QA = [
    ("Tell me about cats.", "Cats are small furry animals that like to sleep.", 1.0),
    ("What is rain?", "Rain is water falling from clouds in drops.", -1.0),
    ("Name a colour.", "Blue is a colour of the sky.", 1.0),
    ("Tell me about dogs.", "Dogs are loyal animals that like to play.", -1.0),
]
# Answers standing in for explored ones: two per prompt, in three minibatches (one per step in turn)
EXPLORED = [
    ("Tell me about cats.", "Cats sleep a lot.", 0.5), ("Tell me about cats.", "Cats hunt mice at night.", -0.5),
    ("What is rain?", "Rain falls.", 0.5), ("What is rain?", "Rain is wet and it falls and falls.", -0.5),
    ("Name a colour.", "Red.", 0.5), ("Name a colour.", "Green is the colour of grass.", -0.5),
]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def data(trainer: Trainer, parent) -> RunData:
    rows = QA + EXPLORED
    samples = [TrainSample(i, chat(q), a, r) for i, (q, a, r) in enumerate(rows)]
    encoded = [encode_sample(trainer.tokenizer, s, 1024) for s in samples]
    return RunData(samples, samples, encoded, [r for _, _, r in rows], parent,
                   explored_groups=[0, 0, 1, 1, 2, 2])


def run(trainer: Trainer, parent, precision: str, out, monkeypatch, stand_in: bool) -> tuple[dict, int]:
    """Three steps over the ratings and three explored minibatches (micro-batches of 64 tokens: several
    per part); the outcome's figures, and how many micro-batch forward passes the run made."""
    monkeypatch.setattr(Trainer, "step_stands_in", property(lambda self: stand_in))
    passes = 0
    real = Trainer._response_logits

    def counted(self, batch):
        nonlocal passes
        passes += 1
        return real(self, batch)

    monkeypatch.setattr(Trainer, "_response_logits", counted)
    cfg = replace(preset("aggressive"), steps=3, explore_minibatches=3, micro_batch_tokens=64, precision=precision,
                  unlikelihood=0.0)
    trainer.seed(0)
    with trainer.adapter(parent, cfg, trainable=True, precision=precision) as session:
        with PolicyGradient().train(trainer, session, data(trainer, parent), cfg, lambda _p: None) as outcome:
            trainer.save(out)
    figures = {"loss": outcome.loss, "mean_kl": outcome.mean_kl, "start_kl": outcome.start_kl,
               "final_kl": outcome.final_kl, "tokens": outcome.accepted_token_frac}
    return figures, passes


@pytest.fixture(scope="module")
def parent(tiny_trainer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("parent") / "v1"
    samples = [TrainSample(i, chat(q), a, r) for i, (q, a, r) in enumerate(QA)]
    tiny_trainer.run(samples, None, replace(preset("aggressive"), steps=2, precision="fp32"), None, folder)
    return folder


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("continues", [False, True], ids=["fresh", "continues"])
def test_the_first_step_stands_in_for_its_batches_passes(tiny_trainer, parent, precision, continues, tmp_path,
                                                          monkeypatch):
    start = parent if continues else None
    before, passes_before = run(tiny_trainer, start, precision, tmp_path / "a", monkeypatch, stand_in=False)
    after, passes_after = run(tiny_trainer, start, precision, tmp_path / "b", monkeypatch, stand_in=True)
    # The micro-batches of the ratings and the first minibatch no longer run a pass before the first step.
    assert passes_after < passes_before
    # The same run: its loss, its KL where it starts and where it ends (what the saved adapter gives)
    assert after == pytest.approx(before, rel=1e-4, abs=1e-7)
    if continues:
        assert after["start_kl"] > 1e-4  # measured at the parent, on the ratings' micro-batches
    else:
        assert after["start_kl"] == 0.0
    assert load_file(tmp_path / "a" / ADAPTER_WEIGHTS).keys() == load_file(tmp_path / "b" / ADAPTER_WEIGHTS).keys()


def test_with_the_step_standing_in_the_first_ratios_are_exactly_one(tiny_trainer, tmp_path):
    """One step at lr 0 whose sequence band lets through a ratio of exactly 1 alone: every sequence
    stays, the step's own pass being the behaviour (a separate pass may round differently: on this
    CPU it loses some of them to such a band; the product's band is 0.8-1.25)."""
    samples = [TrainSample(i, chat(q), a, r) for i, (q, a, r) in enumerate(QA + EXPLORED)]
    cfg = replace(preset("careful"), steps=1, lr=0.0, seq_band=(1.0, 1.0), precision="fp32", micro_batch_tokens=64)
    kept = tiny_trainer.run(samples, None, cfg, None, tmp_path / "v").metrics["accepted_seq_frac"]
    assert kept == 1.0
