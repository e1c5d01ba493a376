"""Hindsight distillation from the user's words (worker/training/hindsight.py): the template, the
term on tensors, the teacher with the adapter off, the gap that gates it, a stronger teacher, and
that a run distils the hint's behaviour into the student on held-out prompts (the torch trainer
here; tests/test_mlx_trainer.py runs the same checks on the MLX one)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_trainer import HELD_OUT, LEARN, TEMPLATES, chat, preference_samples

from rlfleet.shared.errors import ConfigError
from rlfleet.worker.objective import hindsight_kl, per_answer_mean, top_k_kl
from rlfleet.worker.presets import TrainConfig
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training.hindsight import HINT_HEADER, hint_for, signed_gap, with_hint

HINT = "say yes"
TEACH: TrainConfig = replace(LEARN, hindsight=1.0, hindsight_top_k=1024, hindsight_min_gap=-100.0)


# -- the template and who is taught -----------------------------------------------------------------


def test_the_hint_goes_after_the_last_user_turn_and_nothing_else_changes():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Tell me about tea.  "}]
    hinted = with_hint(prompt, "  too long ")
    assert hinted[:3] == prompt[:3]
    assert hinted[3] == {"role": "user", "content": f"Tell me about tea.\n\n{HINT_HEADER}\ntoo long"}
    assert prompt[3]["content"] == "Tell me about tea.  "  # the caller's prompt is not touched
    alone = with_hint([{"role": "system", "content": "Be brief."}], "too long")
    assert alone[-1] == {"role": "user", "content": f"{HINT_HEADER}\ntoo long"}


def test_only_a_fresh_rating_with_words_has_a_hint():
    rated = TrainSample(1, chat("q"), "a", -1.0, comment="  too long ")
    assert hint_for(rated) == "too long"
    assert hint_for(replace(rated, comment=None)) is None
    assert hint_for(replace(rated, comment="   ")) is None
    assert hint_for(replace(rated, rating_id=None)) is None  # an explored answer
    assert hint_for(replace(rated, fixed_advantage=0.4)) is None  # a retraction


def test_the_gap_is_signed_by_the_rating():
    teacher, student = [-1.0, -3.0], [-2.0, -2.0]
    assert signed_gap(teacher, student, 1.0) == pytest.approx(0.0)
    assert signed_gap([-1.0, -1.0], student, 1.0) == pytest.approx(1.0)  # a liked answer made likelier
    assert signed_gap([-1.0, -1.0], student, -1.0) == pytest.approx(-1.0)  # a disliked one too: wrong way
    assert signed_gap([-4.0, -2.0], student, -1.0) == pytest.approx(1.0)


# -- the term on tensors -------------------------------------------------------------------------------


def test_the_hindsight_term_is_the_teachers_kl_and_moves_mass_onto_a_token_the_answer_did_not_use():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(4, 30, generator=gen) * 2, -1)
    student_logits = torch.randn(4, 30, generator=gen)
    ids = teacher.topk(30, -1).indices
    student = torch.log_softmax(student_logits, -1)
    full = (teacher.exp() * (teacher - student)).sum(-1)  # KL(teacher || student), every token
    got = hindsight_kl(student.gather(-1, ids), teacher.gather(-1, ids))
    assert got.tolist() == pytest.approx(full.tolist(), abs=1e-4)
    assert got.tolist() == pytest.approx(top_k_kl(teacher.gather(-1, ids), student.gather(-1, ids)).tolist())

    # One position: the answer used token 0; the teacher wants token 2, which the student barely has.
    t = torch.log(torch.tensor([[0.2, 0.1, 0.6, 0.1]]))
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.02, 0.08]])).requires_grad_(True)
    k = torch.tensor([[2, 0]])  # the teacher's top 2; the rest is its tail bin
    s = torch.log_softmax(logits, -1)
    loss = hindsight_kl(s.gather(-1, k), t.gather(-1, k)).sum()
    loss.backward()
    after = torch.softmax(logits.detach() - 1.0 * logits.grad, -1)
    assert after[0, 2] > 0.02 * 1.5 and after[0, 0] < 0.7

    same = torch.log_softmax(student_logits, -1).topk(8, -1).values.clone().requires_grad_(True)
    zero = hindsight_kl(same, same.detach())
    zero.sum().backward()
    assert zero.abs().max().item() < 1e-6 and same.grad.abs().max().item() < 1e-5


def test_every_taught_answer_weighs_the_same_and_an_untaught_one_counts_in_the_mean():
    values = torch.tensor([1.0, 1.0, 1.0, 4.0, 9.0])  # answer A: 3 positions; B: 1; C (untaught): 1
    weights = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0, 0.0])
    assert per_answer_mean(values, weights, 3).item() == pytest.approx((1.0 + 4.0 + 0.0) / 3)


# -- runs on the tiny model ----------------------------------------------------------------------------


def hinted_samples(which: str = "bad") -> list[TrainSample]:
    """The preference samples, each disliked (or liked) one with the hint as its comment."""
    out = []
    for s in preference_samples():
        words = HINT if (s.reward < 0) == (which == "bad") else None
        out.append(replace(s, comment=words))
    return out


def held_out_hinted() -> list[TrainSample]:
    """Held-out prompts, each with a disliked answer carrying the hint: a run over them with lr 0
    measures KL(teacher || student) there before any update (``hindsight_kl_start``)."""
    return [TrainSample(100 + i, chat(TEMPLATES[i % 4].format(t)), "no no no no", -1.0, comment=HINT)
            for i, t in enumerate(HELD_OUT)]


def distance_to_teacher(trainer, adapter: Path | None, folder: Path, teacher: str) -> float:
    still = replace(TEACH, lr=0.0, steps=1, teacher=teacher)
    return trainer.run(held_out_hinted(), None, still, adapter, folder).metrics["hindsight_kl_start"]


@pytest.fixture(scope="module")
def trainer(tiny_trainer):
    return tiny_trainer


def check_teacher_is_the_base_with_the_hint(trainer, parent: Path, folder: Path) -> None:
    """The teacher runs with the adapter off (a teacher that kept it on would teach the student its own
    distribution: a silently zero term). One hinted 👎 among bare ratings: its gap is the teacher's mean
    log-prob of the answer against the student's, so the teacher's own figure is the student's minus
    the gap; from a fresh adapter and from ``parent``, whose student differs, that figure is the same,
    and the hint really changes it (the gap is not 0)."""
    samples = [replace(s, comment=HINT if i == 1 else None) for i, s in enumerate(preference_samples()[:8])]
    still = replace(TEACH, lr=0.0, steps=1)
    pair = [(samples[1].prompt, samples[1].response)]
    teacher = {}
    students = {}
    for name, adapter in (("fresh", None), ("parent", parent)):
        m = trainer.run(samples, None, still, adapter, folder / name).metrics
        assert (m["hinted"], m["hint_taught"]) == (1, 1)
        students[name] = trainer.mean_logprobs(pair, adapter)[0]
        teacher[name] = students[name] - m["teacher_gap"]  # a 👎: gap = student - teacher
        assert abs(m["teacher_gap"]) > 1e-3 if name == "fresh" else True
    assert abs(students["parent"] - students["fresh"]) > 0.05, students
    assert teacher["parent"] == pytest.approx(teacher["fresh"], abs=1e-4), teacher


def test_the_teacher_is_the_base_with_the_hint_in_context(trainer, tmp_path):
    parent = tmp_path / "parent"
    trainer.run(preference_samples(), None, LEARN, None, parent)
    check_teacher_is_the_base_with_the_hint(trainer, parent, tmp_path)


def other_teacher(student_dir: Path, folder: Path) -> str:
    """The tiny model with its transformer layers perturbed (its embeddings and norms kept): a teacher
    on the same tokenizer whose distributions differ from the student's in ways a LoRA can follow."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student_dir)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * p.std())
    model.save_pretrained(folder)
    shutil.copy(student_dir / "tokenizer.json", folder)
    shutil.copy(student_dir / "tokenizer_config.json", folder)
    return str(folder)


def check_distils_the_teacher_into_held_out_answers(trainer, student_dir: Path, folder: Path) -> None:
    """The same ratings trained with and without the hindsight term: with it, the student ends nearer
    the teacher on held-out prompts, than without it and than the base; the thumbs are still learned
    (the term does not drown the policy gradient). The tiny model barely reads a hint (its gap is about
    1e-4 nats), so the teacher here is another tiny model on the same tokenizer: what is measured is
    that the run moves the student's whole distribution toward the teacher's where it never trained."""
    from test_trainer import held_out_shifts

    teacher = other_teacher(student_dir, folder / "teacher")
    distance = {"base": distance_to_teacher(trainer, None, folder / "d-base", teacher)}
    for weight in (0.0, 64.0):
        out = folder / f"w{weight}"
        cfg = replace(TEACH, hindsight=weight, teacher=teacher)
        m = trainer.run(hinted_samples(), None, cfg, None, out).metrics
        if weight:
            assert m["hint_taught"] == 16 and m["hindsight_kl"] < m["hindsight_kl_start"], m
        else:
            assert "teacher_gap" not in m  # off: the teacher is not even asked
        distance[weight] = distance_to_teacher(trainer, out, folder / f"d{weight}", teacher)
        good_shift, bad_shift = held_out_shifts(trainer, out)
        assert good_shift > 0.05 and bad_shift < -0.05, (weight, good_shift, bad_shift)
    assert distance[64.0] < 0.8 * min(distance["base"], distance[0.0]), distance
    check_the_gate_reads_the_words(trainer, folder, teacher, distance)


def check_the_gate_reads_the_words(trainer, folder: Path, teacher: str, distance: dict) -> None:
    """The gate, held-out answers all 👎 with words: it measures each model's divergence from the
    teacher reading them with the run's own term (the base's mean is the run's ``hindsight_kl_start``),
    the teacher is the same whichever parent is loaded, and the run pulled toward the teacher comes
    closer beyond noise, so the one-class cap does not hold it, while the run without the term does not."""
    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.orchestrate import GateReferences

    held = held_out_hinted()
    # The tiny model's distances are hundredths of a nat: the noise floor is set below them.
    gcfg = GateConfig(hint_top_k=TEACH.hindsight_top_k, hint_teacher=teacher, eval_samples=0,
                      max_kl_one_class=1e-6, max_kl=100.0, min_noise=1e-4)
    refs = GateReferences.measure(trainer, held, None, gcfg, 1024)
    assert len(refs.parent_divergence) == len(held)
    assert sum(refs.parent_divergence) / len(held) == pytest.approx(distance["base"], rel=1e-3)
    from_parent = GateReferences.measure(trainer, held, folder / "w0.0", gcfg, 1024)
    for a, b in zip(refs.hints.teacher, from_parent.hints.teacher, strict=True):
        assert (a.ids == b.ids).all() and abs(a.logprobs - b.logprobs).max() < 1e-4
    pulled, plain = refs.judge(trainer, folder / "w64.0"), refs.judge(trainer, folder / "w0.0")
    m = pulled.metrics
    assert m["heldout_one_class"] and m["heldout_toward_teacher"], m
    assert m["heldout_teacher_div_after"] < m["heldout_teacher_div_before"] - m["heldout_teacher_noise"]
    assert not plain.metrics["heldout_toward_teacher"] and "only bad answers held out" in plain.reason, plain
    assert "only bad answers held out" not in (pulled.reason or "")
    off = GateReferences.measure(trainer, held, None, replace(gcfg, hint_top_k=0), 1024)
    assert off.hints is None and "heldout_toward_teacher" not in off.judge(trainer, folder / "w64.0").metrics


def test_a_run_distils_the_teacher_into_held_out_answers(trainer, tiny_model_dir, tmp_path):
    check_distils_the_teacher_into_held_out_answers(trainer, tiny_model_dir, tmp_path)


def check_the_gap_gates_the_hint(trainer, folder: Path) -> None:
    """A bar no hint clears: nothing is taught, the run says so and measures the gap all the same, and
    the adapter is the one the thumbs alone give."""
    from safetensors.numpy import load_file

    samples = hinted_samples()
    gated = trainer.run(samples, None, replace(TEACH, hindsight_min_gap=100.0), None, folder / "gated").metrics
    assert (gated["hinted"], gated["hint_taught"]) == (16, 0)
    assert isinstance(gated["teacher_gap"], float) and "hindsight_kl" not in gated
    trainer.run(samples, None, replace(TEACH, hindsight=0.0), None, folder / "off")
    a = load_file(str(folder / "gated" / "adapter_model.safetensors"))
    b = load_file(str(folder / "off" / "adapter_model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_the_gap_gates_the_hint(trainer, tmp_path):
    check_the_gap_gates_the_hint(trainer, tmp_path)


def test_a_stronger_teacher_from_a_folder_is_used_and_one_with_another_tokenizer_refused(
    trainer, tiny_model_dir, tmp_path
):
    from tinymodel import build_tiny_model

    samples = [replace(s, comment=HINT if i == 1 else None) for i, s in enumerate(preference_samples()[:8])]
    still = replace(TEACH, lr=0.0, steps=1)
    own = trainer.run(samples, None, still, None, tmp_path / "own").metrics["teacher_gap"]
    # The model's own folder as the teacher: the same weights, so the same gap as the base's.
    same = trainer.run(samples, None, replace(still, teacher=str(tiny_model_dir)), None, tmp_path / "same")
    assert same.metrics["teacher_gap"] == pytest.approx(own, abs=1e-5)
    # A bigger model on the same tokenizer: another teacher, another gap.
    bigger = build_tiny_model(tmp_path / "bigger", seed=3, hidden=96, layers=3)
    other = trainer.run(samples, None, replace(still, teacher=str(bigger)), None, tmp_path / "bigger-run")
    assert abs(other.metrics["teacher_gap"] - own) > 1e-3
    # Another tokenizer (here: another end token) would pair unrelated tokens: refused, with the reason.
    alien = tmp_path / "alien"
    shutil.copytree(tiny_model_dir, alien)
    cfg_file = alien / "tokenizer_config.json"
    import json

    tcfg = json.loads(cfg_file.read_text())
    tcfg["eos_token"] = tcfg.get("bos_token") or "<s>"
    cfg_file.write_text(json.dumps(tcfg))
    with pytest.raises(ConfigError, match="does not share the model's tokenizer"):
        trainer.run(samples, None, replace(still, teacher=str(alien)), None, tmp_path / "alien-run")
    with pytest.raises(ConfigError, match="train.teacher"):
        trainer.run(samples, None, replace(still, teacher=str(tmp_path / "nowhere")), None, tmp_path / "x")


# -- rewrites as positives ------------------------------------------------------------------------------


def check_rewrites_are_the_teachers_answers_the_reward_model_prefers(trainer, folder: Path) -> None:
    """With train.rewrite the teacher answers every prompt with words again, under them; the answers
    kept are exactly those the user's reward model scores above the rated answer, after the prompt
    without the hint, and a run trains on them and says how many."""
    import json

    from rlfleet.worker.training import reward_features
    from rlfleet.worker.training.rewrite import rewrite

    # Words on every rating: a rewrite of a liked answer has a high score to beat, of a disliked one a
    # low; each rating on a prompt of its own, so that a rewrite names the answer it rewrites.
    samples = [replace(s, comment=HINT, prompt=s.prompt if s.reward > 0 else chat(s.prompt[0]["content"] + " Why?"))
               for s in preference_samples()]
    cfg = replace(TEACH, rewrite=True, explore_max_new_tokens=12)
    with trainer.adapter(None, cfg, trainable=True):
        report = reward_features.measure(trainer, samples, cfg.max_tokens, cfg.seed)
        assert report.auc is not None and report.auc >= cfg.reward_model_min_auc
        out = rewrite(trainer, samples, report, cfg)
        originals = {json.dumps(s.prompt): s for s in samples}
        assert out.tried == len(originals) == 32
        assert 0 < len(out.samples) < 32, out.reason  # the reward model kept some and refused others
        for w in out.samples:
            assert w.rating_id is None and HINT_HEADER not in w.prompt[-1]["content"]
            orig = originals[json.dumps(w.prompt)]
            mine, theirs = report.model.score(reward_features.features(trainer, [w, orig], cfg.max_tokens))
            assert mine > theirs
        assert out.advantages == [cfg.explore_weight] * len(out.samples)
    m = trainer.run(samples, None, cfg, None, folder / "run").metrics
    assert (m["rewrites_tried"], m["rewritten"]) == (32, len(out.samples)), m["rewrite_reason"]
    off = trainer.run(samples, None, replace(cfg, rewrite=False), None, folder / "off").metrics
    assert off["rewritten"] == 0 and off["rewrite_reason"] == "off (train.rewrite = false)"


def test_rewrites_are_the_teachers_answers_the_reward_model_prefers(trainer, tmp_path):
    check_rewrites_are_the_teachers_answers_the_reward_model_prefers(trainer, tmp_path)


def test_no_rewrite_without_words_or_a_reward_model_good_enough():
    from rlfleet.worker.training.reward_features import RewardModelReport
    from rlfleet.worker.training.rewrite import why_not

    cfg = replace(TEACH, rewrite=True)
    good = RewardModelReport(auc=0.9, reason="", seconds=0.0, model=object())  # type: ignore[arg-type]
    assert why_not(hinted_samples(), good, cfg) is None
    assert why_not(hinted_samples(), good, replace(cfg, rewrite=False)) == "off (train.rewrite = false)"
    assert why_not(preference_samples(), good, cfg) == "no rating with words to rewrite under"
    weak = replace(good, auc=0.6)
    assert "below train.reward_model_min_auc" in why_not(hinted_samples(), weak, cfg)
    none = RewardModelReport(auc=None, reason="too few liked answers", seconds=0.0)
    assert why_not(hinted_samples(), none, cfg) == "no reward model: too few liked answers"
