"""The MLX trainer on the tiny offline model: peft-format adapters that torch serves, learning, lineage.

Skipped without mlx / mlx-lm (not in the `dev` extra): `pip install -e '.[train,dev,mlx]'`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("mlx.core", exc_type=ImportError, reason="the MLX trainer needs mlx: pip install -e '.[mlx]'")
pytest.importorskip("mlx_lm", exc_type=ImportError, reason="the MLX trainer needs mlx-lm: pip install -e '.[mlx]'")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from test_loops import check_unlikelihood_lowers_the_marked_tokens  # noqa: E402
from test_trainer import (  # noqa: E402
    GOOD,
    LEARN,
    chat,
    check_anchor_reference_is_the_base,
    check_entropy_hinge,
    check_halfway_adapter_is_the_half_run,
    check_replayed_behaviour_is_the_start_policy,
    check_still_at_parent,
    check_stored_behaviour_is_used,
    check_top_k_anchor_holds_near_the_base,
    held_out_shifts,
    learning_run,
    preference_samples,
)

from rlfleet.shared.config import TrainSettings  # noqa: E402
from rlfleet.shared.models import pick_device, resolve_model, serving_device  # noqa: E402
from rlfleet.worker import objective, objective_mlx  # noqa: E402
from rlfleet.worker.presets import preset  # noqa: E402
from rlfleet.worker.training.mlx_backend import MlxTrainer  # noqa: E402
from rlfleet.worker.training.mlx_model import hf_folder, legacy_rope_fields  # noqa: E402
from rlfleet.worker.training.torch_backend import Trainer  # noqa: E402

PAIRS = [
    (chat("Tell me about owls."), "hoot hoot"),
    (chat("Describe clocks briefly."), GOOD),
    (chat("What is rain?"), "a much longer answer, padded less than the others"),
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread) -> None:
    """See tinymodel.one_torch_thread."""


@pytest.fixture(scope="module")
def mlx_trainer(tiny_model_dir) -> MlxTrainer:
    return MlxTrainer(resolve_model(str(tiny_model_dir)))


@pytest.fixture(scope="module")
def torch_trainer(tiny_model_dir) -> Trainer:
    return Trainer(resolve_model(str(tiny_model_dir)))


@pytest.fixture(scope="module")
def learned(mlx_trainer, tmp_path_factory):
    """One MLX learning run shared by the tests that inspect it."""
    return learning_run(mlx_trainer, tmp_path_factory.mktemp("mlx-runs"))


@pytest.fixture(scope="module")
def torch_learned(torch_trainer, tmp_path_factory):
    out = tmp_path_factory.mktemp("torch-runs") / "v0001"
    return out, torch_trainer.run(preference_samples()[:8], None, replace(LEARN, steps=2), None, out)


def torch_mean_logprobs(model, tok, pairs) -> list[float]:
    """Mean response-token log-prob straight from a transformers/peft model, one pair at a time."""
    out = []
    for prompt, response in pairs:
        enc = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        p = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        r = tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
        lp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(-1, torch.tensor(r)[:, None])
        out.append(float(lp.mean()))
    return out


# -- the loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("neg_fade", [0.0, 0.3])
def test_mlx_loss_matches_torch_mispo_loss(neg_fade):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 14
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        mask[b, 3 + b % 3 : T - b % 4] = True
    mask[5] = False  # a row without response tokens (all padding)
    beh = -torch.rand(B, T, generator=gen) * 3
    ref = beh + torch.randn(B, T, generator=gen) * 0.3
    new = beh + torch.randn(B, T, generator=gen) * 0.5  # some tokens and sequences fall outside the bands
    new[0, 0] = float("inf")  # off the mask: must be ignored
    adv = torch.tensor([1.2, -1.0, 0.5, -2.0, 2.0, 1.0])
    kw = dict(token_band=(0.5, 2.0), seq_band=(0.8, 1.25), beta=0.05, neg_fade=neg_fade)

    t_new = new.clone().requires_grad_(True)
    want = objective.mispo_loss(t_new, beh, ref, mask, adv, **kw)
    want.loss.backward()
    assert 0 < want.accepted_token_frac < 1 and 0 < want.accepted_seq_frac < 1  # the filters did filter

    def mx_loss(x):
        out = objective_mlx.mispo_loss(x, mx.array(beh.numpy()), mx.array(ref.numpy()), mx.array(mask.numpy()),
                                       mx.array(adv.numpy()), **kw)  # fmt: skip
        return out.loss, out.stats()

    (loss, stats), grad = mx.value_and_grad(mx_loss)(mx.array(new.numpy()))
    n_tokens = int(mask.sum())
    assert float(loss) == pytest.approx(want.loss.item(), abs=1e-6)
    assert float(stats["n_tokens"]) == want.n_tokens == n_tokens
    assert float(stats["accepted_tokens"]) / n_tokens == pytest.approx(want.accepted_token_frac)
    assert float(stats["accepted_seqs"]) / B == pytest.approx(want.accepted_seq_frac)
    assert float(stats["mean_kl"]) == pytest.approx(want.mean_kl, abs=1e-6)
    np.testing.assert_allclose(np.array(grad), t_new.grad.numpy(), atol=1e-6)
    got_kl = np.array(objective_mlx.k3_kl(mx.array(new[1].numpy()), mx.array(ref[1].numpy())))
    np.testing.assert_allclose(got_kl, objective.k3_kl(new[1], ref[1]).numpy(), rtol=1e-5, atol=1e-6)


def test_mlx_top_k_anchor_matches_torch():
    gen = torch.Generator().manual_seed(1)
    ref = torch.log_softmax(torch.randn(3, 7, 30, generator=gen) * 2, -1)
    ids = ref.topk(8, -1).indices
    new = torch.log_softmax(torch.randn(3, 7, 30, generator=gen), -1).gather(-1, ids)
    ref_top = ref.gather(-1, ids)
    t_new = new.clone().requires_grad_(True)
    want = objective.top_k_kl(t_new, ref_top)
    want.sum().backward()
    got, grad = mx.value_and_grad(lambda x: objective_mlx.top_k_kl(x, mx.array(ref_top.numpy())).sum())(
        mx.array(new.numpy())
    )
    assert float(got) == pytest.approx(want.sum().item(), rel=1e-5)
    np.testing.assert_allclose(np.array(grad), t_new.grad.numpy(), atol=1e-5)


# -- selection --------------------------------------------------------------------------------


def test_mlx_is_a_device_setting_and_selects_the_mlx_trainer(tiny_model_dir, mlx_trainer, torch_trainer,
                                                             monkeypatch):  # fmt: skip
    from rlfleet.worker import backends
    from rlfleet.worker.training import mlx_backend as mlx_mod

    assert TrainSettings(device="mlx").device == "mlx"
    assert pick_device("mlx") == "mlx"
    assert serving_device("mlx") == pick_device("auto")  # adapters are still served by torch
    made = []
    monkeypatch.setattr(mlx_mod.MlxTrainer, "__init__", lambda self, ref, device: made.append((ref, device)))
    ref = resolve_model(str(tiny_model_dir))
    assert isinstance(backends.make_trainer(ref, "mlx"), MlxTrainer) and made == [(ref, "mlx")]
    assert isinstance(backends.make_trainer(ref, "cpu"), Trainer)
    assert mlx_trainer.n_params == torch_trainer.n_params
    assert not mlx_trainer.is_moe
    assert hf_folder(ref) == Path(ref.path)  # a safetensors folder is used as is, not converted


def test_transformers5_rope_parameters_reach_mlx(tiny_model_dir, tmp_path):
    # transformers 5 writes rope_parameters; mlx_lm's llama reads rope_theta and would fall back to
    # 10000 (the tiny model's value, so the other tests cannot see it; the default model's is 1e5).
    folder = tmp_path / "rope"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 50.0
    (folder / "config.json").write_text(json.dumps(config))
    assert legacy_rope_fields(config) == {"rope_theta": 50.0}
    ref = resolve_model(str(folder))
    want = Trainer(ref).mean_logprobs(PAIRS)
    assert MlxTrainer(ref).mean_logprobs(PAIRS) == pytest.approx(want, abs=1e-4)


# -- adapters ---------------------------------------------------------------------------------


def test_saved_adapter_is_a_peft_adapter_that_torch_serves(mlx_trainer, torch_trainer, learned, torch_learned,
                                                           tiny_model_dir):  # fmt: skip
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, result, _ = learned
    torch_out, torch_result = torch_learned
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert result.metrics.keys() == torch_result.metrics.keys()
    # The same tensors (names, shapes, dtype) and the same config as the torch trainer saves.
    mine, theirs = load_file(out / "adapter_model.safetensors"), load_file(torch_out / "adapter_model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in mine.items()} == {k: (v.shape, v.dtype) for k, v in theirs.items()}
    cfg, torch_cfg = (json.loads((d / "adapter_config.json").read_text()) for d in (out, torch_out))
    for key in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "base_model_name_or_path",
                "inference_mode", "use_rslora", "use_dora", "bias"):  # fmt: skip
        assert cfg[key] == torch_cfg[key], key
    assert sorted(cfg["target_modules"]) == sorted(torch_cfg["target_modules"])

    # Served by peft on a fresh transformers copy: the same log-probs as the MLX trainer measures.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    before = torch_mean_logprobs(base, mlx_trainer.tokenizer, PAIRS)
    served = PeftModel.from_pretrained(base, str(out)).eval()
    got = torch_mean_logprobs(served, mlx_trainer.tokenizer, PAIRS)
    assert mlx_trainer.mean_logprobs(PAIRS, out) == pytest.approx(got, abs=1e-3)
    assert torch_trainer.mean_logprobs(PAIRS, out) == pytest.approx(got, abs=1e-5)
    assert max(abs(a - b) for a, b in zip(got, before, strict=True)) > 0.05  # the adapter does something
    assert mlx_trainer.mean_logprobs(PAIRS) == pytest.approx(before, abs=1e-5)  # the base is untouched

    # The other direction: a torch-trained adapter loads into the MLX trainer with the same numbers.
    assert mlx_trainer.mean_logprobs(PAIRS, torch_out) == pytest.approx(
        torch_trainer.mean_logprobs(PAIRS, torch_out), abs=1e-4
    )


def test_learning_moves_held_out_preferences(mlx_trainer, learned):
    out, result, seen = learned
    assert result.promoted_ok and result.reason is None
    assert result.metrics["ratings_used"] == 32 and result.metrics["steps"] == LEARN.steps
    # As on torch: +1 -> 1.2, -1 -> -1, the 👎s then weighted up to the 👍s' total (16 of each).
    assert result.advantages[0] == pytest.approx(1.2) and result.advantages[1] == pytest.approx(-1.2)
    assert seen[0].phase == "reference" and seen[-1].phase == "saving"
    assert [p.step for p in seen if p.phase == "training"] == list(range(0, LEARN.steps + 1))  # 0: steps begin

    good_shift, bad_shift = held_out_shifts(mlx_trainer, out)
    assert good_shift > 0.2, (good_shift, result.metrics)
    assert bad_shift < -0.2, (bad_shift, result.metrics)
    assert result.metrics["accepted_seq_frac"] > 0.5
    assert 0 < result.metrics["mean_kl"] < LEARN.max_mean_kl


def test_first_step_ratios_are_one_and_runs_repeat(mlx_trainer, tmp_path):
    # Reference, behaviour and policy share one fp32 path: before any update every ratio is 1.
    cfg = replace(preset("careful"), steps=1)
    first = mlx_trainer.run(preference_samples()[:8], None, cfg, None, tmp_path / "a").metrics
    assert (first["accepted_seq_frac"], first["accepted_token_frac"], first["mean_kl"]) == (1.0, 1.0, 0.0)
    # Same seed and data, same adapter: nothing of a run leaks into the next.
    mlx_trainer.run(preference_samples()[:4], None, replace(LEARN, steps=2), None, tmp_path / "b")
    mlx_trainer.run(preference_samples()[:4], None, replace(LEARN, steps=2), None, tmp_path / "c")
    wb = mx.load(str(tmp_path / "b" / "adapter_model.safetensors"))
    wc = mx.load(str(tmp_path / "c" / "adapter_model.safetensors"))
    assert wb.keys() == wc.keys() and all(mx.array_equal(wb[k], wc[k]).item() for k in wb)


def test_stored_behaviour_logprobs_are_used(mlx_trainer, tmp_path):
    check_stored_behaviour_is_used(mlx_trainer, tmp_path / "a")


def test_anchor_reference_is_the_base(mlx_trainer, learned, tmp_path):
    parent, _, _ = learned
    check_anchor_reference_is_the_base(mlx_trainer, parent, tmp_path)


def test_the_top_k_anchor_holds_the_next_token_distribution_near_the_base(mlx_trainer, tmp_path):
    check_top_k_anchor_holds_near_the_base(mlx_trainer, tmp_path)


def test_unlikelihood_lowers_the_marked_tokens(mlx_trainer, tmp_path):
    check_unlikelihood_lowers_the_marked_tokens(mlx_trainer, tmp_path / "a")


def test_the_entropy_hinge_compares_with_the_base_and_holds_the_entropy_down(mlx_trainer, learned, tmp_path):
    parent, _, _ = learned
    check_entropy_hinge(mlx_trainer, parent, tmp_path)


def test_the_halfway_adapter_is_the_run_after_half_its_steps(mlx_trainer, tmp_path):
    check_halfway_adapter_is_the_half_run(mlx_trainer, tmp_path)


def test_the_hindsight_teacher_is_the_base_with_the_hint_in_context(mlx_trainer, learned, tmp_path):
    from test_hindsight import check_teacher_is_the_base_with_the_hint

    parent, _, _ = learned
    check_teacher_is_the_base_with_the_hint(mlx_trainer, parent, tmp_path)


def test_a_run_distils_the_hindsight_teacher_into_held_out_answers(mlx_trainer, tiny_model_dir, tmp_path):
    from test_hindsight import check_distils_the_teacher_into_held_out_answers

    check_distils_the_teacher_into_held_out_answers(mlx_trainer, tiny_model_dir, tmp_path)


def test_the_gap_gates_the_hindsight_hint(mlx_trainer, tmp_path):
    from test_hindsight import check_the_gap_gates_the_hint

    check_the_gap_gates_the_hint(mlx_trainer, tmp_path)


def test_hindsight_rewrites_are_the_teachers_answers_the_reward_model_prefers(mlx_trainer, tmp_path):
    from test_hindsight import check_rewrites_are_the_teachers_answers_the_reward_model_prefers

    check_rewrites_are_the_teachers_answers_the_reward_model_prefers(mlx_trainer, tmp_path)


def test_mlx_hindsight_term_matches_torch():
    gen = torch.Generator().manual_seed(4)
    teacher = torch.log_softmax(torch.randn(3, 5, 30, generator=gen) * 2, -1)
    ids = teacher.topk(8, -1).indices
    student = torch.log_softmax(torch.randn(3, 5, 30, generator=gen), -1).gather(-1, ids)
    t_top = teacher.gather(-1, ids)
    weights = torch.rand(3, 5, generator=gen)
    t_student = student.clone().requires_grad_(True)
    want = objective.per_answer_mean(objective.hindsight_kl(t_student, t_top), weights, 3)
    want.backward()
    got, grad = mx.value_and_grad(lambda x: objective_mlx.per_answer_mean(
        objective_mlx.hindsight_kl(x, mx.array(t_top.numpy())), mx.array(weights.numpy()), 3))(
        mx.array(student.numpy()))
    assert float(got) == pytest.approx(want.item(), rel=1e-5)
    np.testing.assert_allclose(np.array(grad), t_student.grad.numpy(), atol=1e-5)


def test_mlx_unlikelihood_matches_torch():
    gen = torch.Generator().manual_seed(2)
    mask = torch.rand(4, 9, generator=gen) > 0.2
    marks = torch.rand(4, 9, generator=gen) > 0.6
    logp = torch.log(torch.rand(4, 9, generator=gen).clamp(min=0.01, max=0.99))
    t_logp = logp.clone().requires_grad_(True)
    want = objective.unlikelihood(t_logp, mask, marks)
    want.backward()
    got, grad = mx.value_and_grad(
        lambda x: objective_mlx.unlikelihood(x, mx.array(mask.numpy()), mx.array(marks.numpy()))
    )(mx.array(logp.numpy()))
    assert float(got) == pytest.approx(want.item(), rel=1e-5)
    np.testing.assert_allclose(np.array(grad), t_logp.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_mlx_entropy_hinge_matches_torch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=gen) * 2
    ref_logits = torch.randn(5, 11, generator=gen) * 2

    def torch_term(x):
        h_ref = objective.next_token_entropy(ref_logits, torch.logsumexp(ref_logits, -1, keepdim=True))
        return objective.entropy_excess(objective.next_token_entropy(x, torch.logsumexp(x, -1, keepdim=True)), h_ref)

    def mlx_term(x):
        r = mx.array(ref_logits.numpy())
        h_ref = objective_mlx.next_token_entropy(r, mx.logsumexp(r, axis=-1, keepdims=True))
        h_new = objective_mlx.next_token_entropy(x, mx.logsumexp(x, axis=-1, keepdims=True))
        return objective_mlx.entropy_excess(h_new, h_ref)

    t = logits.clone().requires_grad_(True)
    want = torch_term(t)
    assert 0 < int((want > 0).sum()) < 5  # some positions flatter than the reference, some not
    want.sum().backward()
    got, grad = mx.value_and_grad(lambda x: mlx_term(x).sum())(mx.array(logits.numpy()))
    # A difference of two entropies in float32: equal to a few units in the sixth digit.
    np.testing.assert_allclose(np.array(mlx_term(mx.array(logits.numpy()))), want.detach().numpy(), rtol=1e-4,
                               atol=1e-5)
    assert float(got) == pytest.approx(want.sum().item(), rel=1e-4)
    np.testing.assert_allclose(np.array(grad), t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_parent_adapter_is_continued(mlx_trainer, learned, tmp_path):
    parent, _, _ = learned
    check_still_at_parent(mlx_trainer, parent, tmp_path / "v2")
    w1 = mx.load(str(parent / "adapter_model.safetensors"))
    w2 = mx.load(str(tmp_path / "v2" / "adapter_model.safetensors"))
    assert w1.keys() == w2.keys() and all(mx.array_equal(w1[k], w2[k]).item() for k in w1)
    assert json.loads((tmp_path / "v2" / "adapter_config.json").read_text()) == json.loads(
        (parent / "adapter_config.json").read_text()
    )
    assert mlx_trainer.mean_logprobs(PAIRS, tmp_path / "v2") == pytest.approx(mlx_trainer.mean_logprobs(PAIRS, parent))
    # And a real step from there moves on from the parent, not from the base.
    moved = mlx_trainer.run(preference_samples()[:8], None, replace(LEARN, steps=1), parent, tmp_path / "v3")
    assert moved.metrics["mean_kl"] > 1e-3 and moved.metrics["accepted_seq_frac"] == 1.0


def test_replayed_samples_start_from_the_parent_as_their_behaviour(mlx_trainer, learned, tmp_path):
    parent, _, _ = learned
    check_replayed_behaviour_is_the_start_policy(mlx_trainer, parent, tmp_path)


def test_gate_scores_match_the_torch_measurement(mlx_trainer, torch_trainer, learned):
    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.training.scoring import score_model

    out, _, _ = learned
    teacher_forced = GateConfig(eval_samples=0)
    for adapter in (None, out):
        got = mlx_trainer.score_model(PAIRS, adapter, teacher_forced)
        want = score_model(torch_trainer, PAIRS, adapter, teacher_forced)
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert got.kl == pytest.approx(want.kl, abs=1e-4) and got.entropy == pytest.approx(want.entropy, abs=1e-4)
    sampled = mlx_trainer.score_model(PAIRS, out, GateConfig(eval_samples=2, eval_new_tokens=8))
    assert 0 <= sampled.distinct2 <= 1 and 0 <= sampled.answer_tokens <= 8
