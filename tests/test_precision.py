"""Training precision (worker/training/precision.py): bf16 where the hardware does it natively, and
importance ratios that stay exactly 1 before any update when recorded fp32 log-probs meet bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rlfleet.shared.config import TrainSettings
from rlfleet.worker.presets import TrainConfig, preset, resolve
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training import precision

X86_BF16 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
"""
X86_PLAIN = "processor\t: 0\nflags\t\t: fpu sse sse2 avx2 avx512f avx512bw\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sha2 crc32 atomics bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    assert precision.flags_have_bf16(precision.cpuinfo_flags(X86_BF16))
    assert precision.flags_have_bf16(precision.cpuinfo_flags(ARM_BF16))
    # AVX-512 alone: oneDNN emulates bf16 there, slower than fp32, so auto keeps fp32.
    assert not precision.flags_have_bf16(precision.cpuinfo_flags(X86_PLAIN))
    assert precision.cpuinfo_flags("no flags here") == frozenset()


def test_auto_follows_the_hardware_and_an_explicit_choice_wins(monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.effective("auto", "cpu") == "bf16"
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)
    assert precision.effective("auto", "cpu") == "fp32"
    assert precision.effective("bf16", "cpu") == "bf16"
    assert precision.effective("fp32", "cuda") == "fp32"
    assert precision.effective("auto", "mps") == "fp32"
    # A toy-sized model gains nothing from bf16 on a CPU (the casts cost more than they save).
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    assert precision.effective("auto", "cpu", width=64) == "fp32"
    assert precision.effective("auto", "cpu", width=576) == "bf16"
    assert precision.effective("bf16", "cpu", width=64) == "bf16"
    with pytest.raises(ValueError, match="unknown precision"):
        precision.effective("fp8", "cpu")


def test_the_config_default_is_auto_and_reaches_the_run():
    assert TrainSettings().precision == "auto"
    assert resolve(TrainSettings(precision="fp32"), device="cpu").precision == "fp32"
    assert resolve(TrainSettings(), device="cpu").precision == "auto"


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


PAIRS = [
    ("Tell me about cats.", "Cats are small furry animals that like to sleep.", -1.0),
    ("What is rain?", "Rain is water falling from clouds in drops.", 1.0),
    ("Name a colour.", "Blue is a colour of the sky.", -1.0),
]


def recorded(trainer, parent=None) -> list[TrainSample]:
    """The ratings with behaviour log-probs recorded in fp32 by the policy that answered (``parent``,
    or the base), as the responder records them."""
    tok = trainer.tokenizer
    out = []
    for i, (q, a, reward) in enumerate(PAIRS):
        ids = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        lps = trainer.token_logprobs([(chat(q), a)], parent)[0]
        out.append(TrainSample(i, chat(q), a, reward, behaviour_logprobs=lps, behaviour_token_ids=ids))
    return out


def first_step(trainer, samples, prec: str, out, parent=None) -> dict:
    """One step at lr 0 with a sequence band of +-1e-5: a sequence stays only if its ratio is 1 to
    within rounding of fp32."""
    cfg: TrainConfig = replace(preset("careful"), steps=1, lr=0.0, seq_band=(1 - 1e-5, 1 + 1e-5), precision=prec)
    return trainer.run(samples, None, cfg, parent, out).metrics


def test_a_bf16_session_computes_in_bf16(tiny_trainer):
    samples = recorded(tiny_trainer)
    pairs = [(s.prompt, s.response) for s in samples]
    fp32 = tiny_trainer.token_logprobs(pairs)
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        assert tiny_trainer.precision == "bf16"
        with tiny_trainer.full_precision():
            assert tiny_trainer.precision == "fp32"
        assert tiny_trainer.precision == "bf16"
    assert tiny_trainer.precision == "fp32"  # the session closed
    from rlfleet.worker.batching import encode_sample

    enc = [encode_sample(tiny_trainer.tokenizer, s, 1024) for s in samples]
    _, batches = tiny_trainer.batches(enc, 4096)
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        bf16 = tiny_trainer.logprobs(batches[0])
        with tiny_trainer.full_precision():
            exact = tiny_trainer.logprobs(batches[0])
    mask = batches[0]["response_mask"]
    assert float((bf16 - exact)[mask].abs().max()) > 1e-6  # bf16 rounding shows
    assert float((bf16 - exact)[mask].abs().mean()) < 0.05  # and is only rounding
    assert sorted(round(x, 4) for row in fp32 for x in row) == sorted(round(float(x), 4) for x in exact[mask])


def test_recorded_fp32_logprobs_give_ratios_of_one_in_a_bf16_run(tiny_trainer, tmp_path):
    samples = recorded(tiny_trainer)
    bf16 = first_step(tiny_trainer, samples, "bf16", tmp_path / "a")
    assert bf16["precision"] == "bf16"
    assert (bf16["accepted_seq_frac"], bf16["accepted_token_frac"]) == (1.0, 1.0)
    assert first_step(tiny_trainer, samples, "fp32", tmp_path / "b")["precision"] == "fp32"


def test_without_the_rounding_correction_the_same_band_drops_them(tiny_trainer, tmp_path, monkeypatch):
    # The control: the recorded values taken as they are, bf16 rounding alone moves every ratio out of
    # the +-1e-5 band, so the test above measures the correction.
    import contextlib

    monkeypatch.setattr(tiny_trainer, "full_precision", lambda: contextlib.nullcontext())
    raw = first_step(tiny_trainer, recorded(tiny_trainer), "bf16", tmp_path / "a")
    assert raw["accepted_seq_frac"] < 1.0


def test_from_a_parent_adapter_the_correction_is_measured_at_the_parent(tiny_trainer, tmp_path):
    parent = tmp_path / "parent"
    cfg = replace(preset("aggressive"), steps=2, precision="fp32")
    tiny_trainer.run(recorded(tiny_trainer), None, cfg, None, parent)
    samples = recorded(tiny_trainer, parent)
    out = first_step(tiny_trainer, samples, "bf16", tmp_path / "a", parent)
    assert (out["accepted_seq_frac"], out["accepted_token_frac"]) == (1.0, 1.0)
    assert out["mean_kl"] > 1e-4  # the run started at the parent, not at the base


def test_bf16_training_moves_the_model_as_fp32_does(tiny_trainer, tmp_path):
    """Same ratings, same seed: a bf16 run's adapter moves the rated answers' log-probs the way the fp32
    run's does (the 👍 up, the 👎s down), and by about as much."""
    samples = [replace(s, behaviour_logprobs=None, behaviour_token_ids=None) for s in recorded(tiny_trainer)]
    pairs = [(s.prompt, s.response) for s in samples]
    before = torch.tensor(tiny_trainer.mean_logprobs(pairs))
    moved = {}
    for prec in ("fp32", "bf16"):
        cfg = replace(preset("aggressive"), steps=4, precision=prec)
        tiny_trainer.run(samples, None, cfg, None, tmp_path / prec)
        moved[prec] = torch.tensor(tiny_trainer.mean_logprobs(pairs, tmp_path / prec)) - before
    signs = torch.tensor([s.reward for s in samples])
    assert bool((moved["fp32"] * signs > 0).all()) and bool((moved["bf16"] * signs > 0).all())
    assert torch.allclose(moved["bf16"], moved["fp32"], rtol=0.25, atol=1e-3)


def _pass_with_grads(trainer, batch) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One bf16 forward and backward of the session's policy: its log-probs, the LoRA gradients, and
    how many dtype copies (``aten::_to_copy``) the pass made."""
    from torch.profiler import ProfilerActivity, profile

    for p in trainer._params:
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lp = trainer._logprobs(batch)
        lp[batch["response_mask"]].sum().backward()
    copies = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
    return lp.detach(), [p.grad.clone() for p in trainer._params], copies


def test_bf16_lora_inputs_are_not_cast_up_and_back(tiny_trainer, monkeypatch):
    """Under autocast peft would cast a bf16 input to the adapter's fp32 and autocast straight back:
    the session leaves those casts out, with bit-identical log-probs and gradients."""
    from rlfleet.worker.batching import encode_sample

    enc = [encode_sample(tiny_trainer.tokenizer, s, 1024) for s in recorded(tiny_trainer)]
    _, batches = tiny_trainer.batches(enc, 4096)
    cfg = preset("careful")
    with tiny_trainer.adapter(None, cfg, trainable=True, precision="bf16") as model:
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a fresh LoRA's B is 0: give the adapter something to say
                torch.nn.init.normal_(p, std=0.05)
        tiny_trainer._params = [p for p in model.parameters() if p.requires_grad]
        lean = _pass_with_grads(tiny_trainer, batches[0])
        with tiny_trainer.autocast():
            assert all(not layer.cast_input_dtype_enabled for layer in tiny_trainer._lora)
        assert all(layer.cast_input_dtype_enabled for layer in tiny_trainer._lora)  # restored after
        monkeypatch.setattr(tiny_trainer, "_lora", [])  # peft's own casting, as before
        cast = _pass_with_grads(tiny_trainer, batches[0])
    assert torch.equal(lean[0], cast[0])
    assert all(torch.equal(a, b) for a, b in zip(lean[1], cast[1], strict=True))
    assert lean[2] < cast[2], (lean[2], cast[2])


def test_a_bf16_session_holds_the_frozen_weights_in_bf16_with_the_same_products(tiny_trainer, monkeypatch):
    """Autocast would cast every frozen weight to bf16 again on every forward pass: a bf16 session
    holds them in bf16 from its start, with bit-identical log-probs and gradients, the fp32 weights
    inside full_precision (and generate), and the base's own fp32 weights once it closes."""
    from rlfleet.worker.batching import encode_sample

    enc = [encode_sample(tiny_trainer.tokenizer, s, 1024) for s in recorded(tiny_trainer)]
    _, batches = tiny_trainer.batches(enc, 4096)
    before = {n: p.detach().clone() for n, p in tiny_trainer.base.named_parameters()}
    linears = [m for m in tiny_trainer.base.modules() if isinstance(m, torch.nn.Linear)]
    with tiny_trainer.adapter(None, preset("careful"), trainable=True, precision="bf16") as model:
        torch.manual_seed(0)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a fresh LoRA's B is 0: give the adapter something to say
                torch.nn.init.normal_(p, std=0.05)
        tiny_trainer._params = [p for p in model.parameters() if p.requires_grad]
        frozen = [layer.get_base_layer().weight for layer in tiny_trainer._lora]
        assert len(tiny_trainer._frozen) == len(frozen) > 0
        assert all(w.dtype == torch.bfloat16 for w in frozen)
        held = _pass_with_grads(tiny_trainer, batches[0])
        with tiny_trainer.full_precision():
            assert all(w.dtype == torch.float32 for w in frozen)
        assert all(w.dtype == torch.bfloat16 for w in frozen)
        drawn = tiny_trainer.sample([s.prompt for s in recorded(tiny_trainer)][:2], 4, seed=0)
        assert len(drawn) == 2 and all(w.dtype == torch.bfloat16 for w in frozen)
        tiny_trainer._frozen.hold(half=False)  # autocast casting the fp32 weights on every pass, as before
        cast = _pass_with_grads(tiny_trainer, batches[0])
        tiny_trainer._frozen.hold(half=True)
    assert torch.equal(held[0], cast[0])
    assert all(torch.equal(a, b) for a, b in zip(held[1], cast[1], strict=True))
    assert held[2] < cast[2], (held[2], cast[2])  # the casts left out
    assert len(tiny_trainer._frozen) == 0 and all(m.weight.dtype == torch.float32 for m in linears)
    assert all(torch.equal(p, before[n]) for n, p in tiny_trainer.base.named_parameters())
    with tiny_trainer.adapter(None, preset("careful"), precision="fp32"):
        assert len(tiny_trainer._frozen) == 0  # an fp32 session holds nothing twice
    # Without the memory to spare for the copies, a bf16 session casts on every pass, as before.
    from rlfleet.worker.training import torch_backend

    assert torch_backend.spare_memory() > 0  # read on this (Linux) machine
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        fresh = tiny_trainer.logprobs(batches[0])
    monkeypatch.setattr(torch_backend, "spare_memory", lambda: 0)
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        assert len(tiny_trainer._frozen) == 0 and all(m.weight.dtype == torch.float32 for m in linears)
        assert torch.equal(tiny_trainer.logprobs(batches[0]), fresh)


def test_a_bf16_session_runs_the_output_head_in_bf16_for_every_pass(tiny_trainer):
    """The output head's product over the vocabulary runs on a bf16 copy of the frozen head, made once
    and kept: a bf16 session's logits are bf16 values widened (fp32 elsewhere), the same for a row
    whether it runs alone or in a batch (what the kept log-probs and the ratios rely on), and within
    bf16 rounding of the fp32 head's."""
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.training.torch_backend import HalfHead, _head_logits

    enc = [encode_sample(tiny_trainer.tokenizer, s, 1024) for s in recorded(tiny_trainer)]
    _, batches = tiny_trainer.batches(enc, 4096)
    with tiny_trainer.adapter(None, preset("careful"), precision="fp32"):
        exact = tiny_trainer._response_logits(batches[0])[0]
    assert not torch.equal(exact, exact.bfloat16().float())
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        logits = tiny_trainer._response_logits(batches[0])[0]
        with tiny_trainer.full_precision():
            assert torch.equal(tiny_trainer._response_logits(batches[0])[0], exact)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits.bfloat16().float())
    scale = exact.abs().max()
    assert 0 < float((logits - exact).abs().max()) < 0.02 * float(scale)

    head = tiny_trainer.base.get_output_embeddings()
    half = HalfHead()
    states = torch.randn(7, head.weight.shape[1])
    together = _head_logits(head, states, half)
    kept = half.weight(head)
    assert kept.dtype == torch.bfloat16 and half.weight(head) is kept  # made once
    assert head.weight.dtype == torch.float32  # the model's own head untouched
    assert all(torch.equal(_head_logits(head, states[i:i + 1], half)[0], together[i]) for i in range(7))
    trained = torch.nn.Linear(head.weight.shape[1], 11, bias=True)  # a head that trains is cast per call
    x = torch.randn(3, head.weight.shape[1], requires_grad=True)
    _head_logits(trained, x, half).sum().backward()
    assert trained.weight.grad is not None and x.grad is not None and half.weight(head) is kept
