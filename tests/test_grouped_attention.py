"""The stacked grouped-query attention of CPU bf16 training passes (worker/training/grouped_attention.py):
the same attention as SDPA within bf16 rounding, values and gradients, on every mask a pass gives it;
SDPA itself wherever it does not apply; and the trainer's passes use it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlfleet.worker.training import grouped_attention as ga

B, H, KV, D = 3, 6, 2, 16


def _qkv(lq: int, lk: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, lq, D, generator=g), torch.randn(B, KV, lk, D, generator=g),
            torch.randn(B, KV, lk, D, generator=g))


def _truth(q, k, v, mask, causal):
    """fp32 SDPA over the key/value heads repeated per query head, as ``[B, Lq, H, D]``."""
    rep = H // KV
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, is_causal=causal)
    return out.transpose(1, 2)


def _both(lq, lk, mask, causal, rows=slice(None)):
    """(grouped in bf16, SDPA in bf16, fp32 truth) outputs and the gradients of a fixed projection of
    them with respect to the queries, keys and values, on the query rows ``rows``."""
    results = []
    for kind in ("grouped", "sdpa", "truth"):
        q, k, v = (t.requires_grad_() for t in _qkv(lq, lk))
        if kind == "grouped":
            out = ga.grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, D ** -0.5, causal).float()
        elif kind == "sdpa":
            rep = H // KV
            out = F.scaled_dot_product_attention(
                q.bfloat16(), k.bfloat16().repeat_interleave(rep, 1), v.bfloat16().repeat_interleave(rep, 1),
                attn_mask=mask, is_causal=causal).transpose(1, 2).float()
        else:
            out = _truth(q, k, v, mask, causal)
        weights = torch.linspace(-1, 1, out[:, rows].numel()).view_as(out[:, rows])
        (out[:, rows] * weights).sum().backward()
        results.append((out[:, rows].detach(), [t.grad for t in (q, k, v)]))
    return results


def _close_as_sdpa(results):
    """The grouped path is as near the fp32 truth as SDPA in bf16 is (within bf16 rounding of it)."""
    (g_out, g_grads), (s_out, s_grads), (t_out, t_grads) = results
    for mine, theirs, truth in [(g_out, s_out, t_out), *zip(g_grads, s_grads, t_grads, strict=True)]:
        scale = float(truth.abs().max())
        err, sdpa_err = float((mine - truth).abs().max()), float((theirs - truth).abs().max())
        assert err <= 2 * sdpa_err + 0.01 * scale, (err, sdpa_err, scale)


def test_causal_without_a_mask_matches_sdpa():
    _close_as_sdpa(_both(20, 20, None, True))


def test_a_padding_mask_matches_sdpa_and_a_row_with_no_key_stays_finite():
    lq = 12
    mask = torch.ones(lq, lq, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    mask[1, :, :, :4] = False  # row 1 is left-padded: its first four positions read no key at all
    out = ga.grouped_attention(*(t.bfloat16() for t in _qkv(lq, lq)), mask, D ** -0.5, False)
    assert torch.isfinite(out.float()).all()
    mask[1, :, :4, 0] = True  # SDPA's truth needs a key on every row: compare where the rows are real
    _close_as_sdpa(_both(lq, lq, mask, False))


def test_a_shared_prefix_mask_wider_than_the_queries_matches_sdpa():
    lq, prefix = 10, 7  # queries after a cached prefix read it whole and themselves causally
    mask = torch.ones(lq, prefix + lq, dtype=torch.bool)
    mask[:, prefix:] = torch.ones(lq, lq, dtype=torch.bool).tril()
    _close_as_sdpa(_both(lq, prefix + lq, mask[None, None].expand(B, 1, lq, prefix + lq), False))


def test_an_additive_mask_matches_sdpa():
    lq = 9
    bias = torch.zeros(lq, lq).masked_fill(~torch.ones(lq, lq, dtype=torch.bool).tril(), float("-inf"))
    bias = bias + torch.linspace(-0.5, 0.5, lq)  # a bias beside the causal part
    _close_as_sdpa(_both(lq, lq, bias[None, None].expand(B, 1, lq, lq), False))


def test_the_backward_keeps_the_scores_once_in_bf16():
    lq = 32
    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(lq, lq))
    mask = torch.ones(lq, lq, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    kept: list[torch.Tensor] = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ga.grouped_attention(q, k, v, mask, D ** -0.5, False)
    n_scores = B * H * lq * lq
    score_sized = [t for t in kept if t.numel() >= n_scores]
    # the probabilities, kept by the softmax and by the product with the values: one bf16 tensor
    assert {t.data_ptr() for t in score_sized} and all(t.dtype == torch.bfloat16 for t in score_sized)
    assert len({t.data_ptr() for t in score_sized}) == 1


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = H // KV


def test_calls_it_does_not_serve_are_sdpas_own():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Module()
    q, k, v = _qkv(8, 8)
    cases = [
        dict(query=q, key=k, value=v),  # fp32 outside autocast
        dict(query=q[:, :, :1].bfloat16(), key=k.bfloat16(), value=v.bfloat16()),  # one query: decoding
    ]
    for case in cases:
        mine, _ = ga.attention_forward(module, attention_mask=None, **case)
        theirs, _ = sdpa_attention_forward(module, attention_mask=None, **case)
        assert torch.equal(mine, theirs)
    big = int((ga.MAX_SCORES / (B * H)) ** 0.5) + 8  # scores beyond the cap: the fused kernel's memory
    q, k, v = (t.bfloat16() for t in _qkv(big, big))
    assert not ga.applies(q, k, 0.0, {})
    assert ga.applies(q[:, :, :64], k[:, :, :64], 0.0, {})
    assert not ga.applies(q[:, :, :64], k[:, :, :64], 0.1, {})  # dropout
    assert not ga.applies(q[:, :, :64], k[:, :, :64], 0.0, {"softcap": 30.0})


def test_under_cpu_bf16_autocast_fp32_queries_take_the_grouped_path(monkeypatch):
    calls = []
    real = ga.grouped_attention
    monkeypatch.setattr(ga, "grouped_attention", lambda *a: calls.append(a[0].dtype) or real(*a))
    q, k, v = _qkv(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the rotary embedding leaves fp32 queries here
        out, _ = ga.attention_forward(_Module(), q, k, v, None)
    assert calls == [torch.float32] and out.dtype == torch.bfloat16


def test_the_cpu_trainer_attends_this_way_in_bf16_sessions(tiny_trainer, monkeypatch):
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.presets import preset
    from rlfleet.worker.samples import TrainSample

    assert tiny_trainer.base.config._attn_implementation == ga.NAME
    samples = [TrainSample(rating_id=i, prompt=[{"role": "user", "content": f"question {i}?"}],
                           response=f"an answer of some length, number {i}.", reward=1.0) for i in range(3)]
    enc = [encode_sample(tiny_trainer.tokenizer, s, 1024) for s in samples]
    _, batches = tiny_trainer.batches(enc, 4096)
    calls = []
    real = ga.grouped_attention
    monkeypatch.setattr(ga, "grouped_attention", lambda *a: calls.append(1) or real(*a))
    with tiny_trainer.adapter(None, preset("careful"), precision="bf16"):
        grouped = tiny_trainer.logprobs(batches[0])
        assert calls  # every layer's attention of the pass
        tiny_trainer.base.set_attn_implementation("sdpa")
        try:
            sdpa = tiny_trainer.logprobs(batches[0])
        finally:
            tiny_trainer.base.set_attn_implementation(ga.NAME)
    mask = batches[0]["response_mask"]
    assert float((grouped - sdpa)[mask].abs().max()) < 0.05  # bf16 rounding apart


def test_the_softmax_is_fp32_softmax_rounded_to_bf16_and_its_gradient_too():
    g = torch.Generator().manual_seed(3)
    scores = (torch.randn(2, 3, 40, 40, generator=g) * 4).bfloat16().requires_grad_()
    mask = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    probs = ga._Softmax.apply(scores, mask)
    # the forward: the fp32 softmax of the bf16 scores, rounded once
    exact = torch.softmax(scores.detach().float().masked_fill(~mask, float("-inf")), -1)
    assert probs.dtype == torch.bfloat16
    assert torch.allclose(probs.float(), exact, rtol=2 ** -8, atol=0.0)
    upstream = torch.randn(probs.shape, generator=g).bfloat16()
    probs.backward(upstream)
    p, u = probs.detach().float(), upstream.float()
    want = (u - (u * p).sum(-1, keepdim=True)) * p  # the gradient, all in fp32
    got = scores.grad
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-6 * float(want.abs().max()))
    assert float(got.float()[..., ~mask[0, 0]].abs().max()) == 0.0  # masked scores get no gradient


def test_a_scale_that_is_not_a_power_of_two_matches_sdpa():
    lq = 24  # the scale rounds on the bf16 queries, as SDPA's math path rounds it
    mask = torch.ones(lq, lq, dtype=torch.bool).tril()[None, None]
    scale = 3 * D ** -0.5 / 2
    results = []
    for kind in ("grouped", "truth"):
        q, k, v = (t.requires_grad_() for t in _qkv(lq, lq, seed=5))
        if kind == "grouped":
            out = ga.grouped_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, scale, False).float()
        else:
            rep = H // KV
            out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                 attn_mask=mask, scale=scale).transpose(1, 2)
        out.sum().backward()
        results.append([out.detach(), *(t.grad for t in (q, k, v))])
    for mine, truth in zip(*results, strict=True):
        assert float((mine - truth).abs().max()) <= 0.03 * float(truth.abs().max())
