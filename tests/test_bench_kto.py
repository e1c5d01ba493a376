"""The learning benchmark's KTO baseline (bench/learning/kto.py): TRL's KTOTrainer behind our trainer
interface, on the tiny offline model and test_trainer's preference data."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", reason="the KTO baseline needs TRL: pip install -e '.[bench]'")

from test_trainer import (  # noqa: E402
    GOOD,
    LEARN,
    assert_adapter_acts_and_unloads,
    base_logits,
    chat,
    held_out_shifts,
    learning_run,
    preference_samples,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: bench/
from bench.learning.kto import KtoTrainer  # noqa: E402

# The same learning config as test_trainer's own learning test (lr 3e-3, 8 steps): KTO learns at it
# too. Measured over seeds 0-3: held-out GOOD +0.49..+0.51, BAD -0.85..-0.93, final KL ~0.37.
KTO_LEARN = LEARN


@pytest.fixture(scope="module")
def kto(tiny_trainer) -> KtoTrainer:
    return KtoTrainer(tiny_trainer)


@pytest.fixture(scope="module")
def learned(kto, tmp_path_factory):
    """One KTO learning run shared by the tests that inspect it, with the base's logits before it."""
    before = base_logits(kto.trainer)
    return *learning_run(kto, tmp_path_factory.mktemp("kto-runs"), KTO_LEARN), before


def test_interface_delegates_to_the_wrapped_trainer(kto):
    t = kto.trainer
    assert kto.base is t.base and kto.tokenizer is t.tokenizer and kto.ref is t.ref
    assert (kto.device, kto.n_params, kto.is_moe) == (t.device, t.n_params, t.is_moe)
    assert kto.adapter.__self__ is t and kto.batches.__self__ is t  # what the gate and benchmark call
    pairs = [(chat("What is tea?"), GOOD)]
    assert kto.mean_logprobs(pairs) == t.mean_logprobs(pairs)


def test_run_writes_a_loadable_adapter_and_leaves_the_base_clean(kto, learned):
    out, result, seen, before = learned
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".safetensors")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    for key in (
        "ratings_used", "retractions", "mean_advantage", "loss", "mean_kl", "final_mean_kl",
        "accepted_token_frac", "accepted_seq_frac", "tokens_per_s", "seconds", "steps", "lr", "n_tokens",
    ):  # fmt: skip
        assert key in result.metrics, key
    assert (result.metrics["ratings_used"], result.metrics["retractions"]) == (32, 0)
    assert result.metrics["steps"] == KTO_LEARN.steps and result.metrics["batch_size"] == 32
    assert result.promoted_ok and result.reason is None
    assert result.advantages[0] == 1.0 and result.advantages[1] == -1.0 and len(result.advantages) == 32
    assert [p.step for p in seen if p.phase == "training"] == list(range(1, KTO_LEARN.steps + 1))
    assert seen[0].loss == pytest.approx(0.5)  # policy == reference (the base) before the first update
    assert seen[-1].phase == "saving" and seen[-1].loss < 0.45

    base = kto.base
    assert not any("lora" in name for name, _ in base.named_modules())
    assert "forward" not in vars(base)  # TRL's fused LM head patch is gone
    assert torch.equal(base_logits(kto.trainer), before)
    assert_adapter_acts_and_unloads(kto.trainer, out, before)


def test_kto_moves_held_out_preferences(kto, learned):
    out, result, _, _ = learned
    good_shift, bad_shift = held_out_shifts(kto, out)
    assert good_shift > 0.3, (good_shift, result.metrics)
    assert bad_shift < -0.5, (bad_shift, result.metrics)
    assert 0 < result.metrics["final_mean_kl"] < KTO_LEARN.max_mean_kl


def test_parent_is_continued_against_the_base(kto, learned, tmp_path):
    from safetensors.torch import load_file

    parent = learned[0]
    # lr 0 keeps the parent's weights. The reference is the base, not a copy of the parent (what TRL
    # does on its own for a PeftModel): at the parent, GOOD is already above the reference and BAD
    # below it, so the first step's loss is under the 0.5 of policy == reference.
    cfg = replace(KTO_LEARN, lr=0.0, steps=1)
    result = kto.run(preference_samples(), None, cfg, parent, tmp_path / "v2")
    assert result.metrics["loss"] < 0.45
    assert result.metrics["final_mean_kl"] == pytest.approx(learned[1].metrics["final_mean_kl"], rel=1e-4)
    w1 = load_file(parent / "adapter_model.safetensors")
    w2 = load_file(tmp_path / "v2" / "adapter_model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    assert not any("lora" in name for name, _ in kto.base.named_modules())
