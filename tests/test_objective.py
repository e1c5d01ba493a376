"""The training objective against values computed by hand (docs/objective.md)."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.worker.objective import (
    advantages,
    entropy_excess,
    fade_negatives,
    k3_kl,
    loss_for,
    mispo_loss,
    next_token_entropy,
    soft_loss,
    top_k_kl,
    unlikelihood,
    update_ema,
)

LN = math.log
WIDE = (0.0, float("inf"))


def test_advantage_baseline_pos_weight_and_clip():
    r = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert advantages(r, ema=0.5, pos_weight=1.2).tolist() == pytest.approx([0.6, -1.5, 0.6, -1.5])
    # Good answers against a very negative baseline: (1 - -1) * 1.2 = 2.4, clipped to 2.
    assert advantages(r[:2], ema=-1.0, pos_weight=1.2).tolist() == pytest.approx([2.0, 0.0])
    # pos_weight never touches bad answers; the clip is symmetric.
    assert advantages(torch.tensor([-1.0, 1.0]), ema=0.9, pos_weight=3.0, clip=0.5).tolist() == pytest.approx(
        [-0.5, 0.3]
    )


def test_ema_starts_neutral_then_moves_toward_the_rewards():
    expected = 0.0
    for r in (1, 1, -1, 1):
        expected = 0.99 * expected + 0.01 * r
    assert expected == pytest.approx(0.01960399, abs=1e-7)
    assert update_ema(None, [1, 1, -1, 1]) == pytest.approx(expected)
    assert update_ema(0.2, [1.0]) == pytest.approx(0.208)
    assert update_ema(0.2, [1.0], decay=0.5) == pytest.approx(0.6)
    assert update_ema(0.3, []) == pytest.approx(0.3)
    assert update_ema(None, []) == 0.0


def test_k3_kl_values():
    new = torch.tensor([LN(0.5), LN(0.5), LN(0.5)])
    ref = torch.tensor([LN(0.25), LN(0.5), LN(1.0)])
    # d = ref - new = [ln .5, 0, ln 2]: exp(d) - d - 1
    assert k3_kl(new, ref).tolist() == pytest.approx([0.5 + LN(2) - 1, 0.0, 2 - LN(2) - 1], abs=1e-6)


def _full_kl(new_logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    new, ref = torch.log_softmax(new_logits, -1), torch.log_softmax(ref_logits, -1)
    return (new.exp() * (new - ref)).sum(-1)


def _top(new_logits: torch.Tensor, ref_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' log-probs at the reference's k likeliest tokens."""
    new, ref = torch.log_softmax(new_logits, -1), torch.log_softmax(ref_logits, -1)
    ids = ref.topk(k, -1).indices
    return new.gather(-1, ids), ref.gather(-1, ids)


def test_top_k_kl_is_the_full_kl_with_every_token_and_a_lower_bound_with_fewer():
    gen = torch.Generator().manual_seed(0)
    ref_logits = torch.randn(5, 40, generator=gen) * 2
    new_logits = ref_logits + torch.randn(5, 40, generator=gen)
    full = _full_kl(new_logits, ref_logits)
    # K = V: the tail bin is empty (floored), and the K bins are the whole distribution.
    assert top_k_kl(*_top(new_logits, ref_logits, 40)).tolist() == pytest.approx(full.tolist(), abs=1e-4)
    # Fewer bins: merging bins never raises a KL (log-sum inequality), and it grows toward the full KL.
    few, more = top_k_kl(*_top(new_logits, ref_logits, 4)), top_k_kl(*_top(new_logits, ref_logits, 16))
    assert bool((few <= more + 1e-6).all()) and bool((more <= full + 1e-6).all())
    assert bool((few > 0).all())
    # At new = ref: zero, with zero gradient.
    same = torch.log_softmax(ref_logits, -1).topk(8, -1).values.clone().requires_grad_(True)
    kl = top_k_kl(same, same.detach())
    kl.sum().backward()
    assert kl.abs().max().item() < 1e-6 and same.grad.abs().max().item() < 1e-5


def test_top_k_kl_sees_mass_moving_between_tokens_the_answer_did_not_use():
    """What the k3 estimate on the answer's own token cannot see: the token keeps its probability
    while the rest moves onto one other token (as a push off a 👎 answer moves it)."""
    ref = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    new = torch.log(torch.tensor([[0.5, 0.45, 0.025, 0.025]]))
    answered = torch.tensor([0])  # the answer's token: its probability did not move
    assert k3_kl(new[0, answered], ref[0, answered]).item() == pytest.approx(0.0, abs=1e-7)
    assert top_k_kl(new[:, :3], ref[:, :3]).item() > 0.1


def test_the_anchor_replaces_the_k3_term_in_the_loss():
    mask = torch.tensor([[1, 1, 0]])
    beh = torch.tensor([[-1.0, -2.0, -3.0]])
    new = _leaf(beh.tolist())
    adv = torch.tensor([0.0])  # no policy term: the loss is the KL term alone
    anchor = torch.tensor([[0.3, 0.1, 99.0]], requires_grad=True)  # padding ignored
    out = mispo_loss(new, beh, beh - 0.5, mask, adv, seq_band=(0.5, 2.0), beta=0.5, anchor=anchor)
    assert out.loss.item() == pytest.approx(0.5 * (0.3 + 0.1) / 2)
    assert out.mean_kl == pytest.approx(k3_kl(torch.tensor(0.0), torch.tensor(-0.5)).item())  # still reported
    out.loss.backward()
    assert anchor.grad[0].tolist() == pytest.approx([0.25, 0.25, 0.0])
    soft = soft_loss(new, beh, beh, mask, adv, beta=0.5, anchor=anchor.detach())
    assert soft.loss.item() == pytest.approx(0.5 * 0.2)

    class Cfg:
        objective, token_band, seq_band, beta = "mispo", (0.5, 2.0), (0.5, 2.0), 0.5

    bound = loss_for(Cfg())(new, beh, beh, mask, adv, anchor=anchor)
    assert bound.loss.item() == pytest.approx(out.loss.item())


def test_unlikelihood_on_marked_tokens_value_and_gradient():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    marks = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]])  # [0, 0] and [1, 2] are off the mask: ignored
    logp = _leaf([[LN(0.9), LN(0.5), LN(0.8), LN(0.1)], [LN(0.3), LN(0.6), LN(0.99), 0.0]])
    loss = unlikelihood(logp, mask, marks)
    # Row 0: -(ln 0.2 + ln 0.9) / 3; row 1: -ln 0.4 / 2; the mean over the two answers.
    want = (-(LN(0.2) + LN(0.9)) / 3 - LN(0.4) / 2) / 2
    assert loss.item() == pytest.approx(want, rel=1e-5)
    loss.backward()
    # d/dlogp of -log(1 - exp(logp)) = p / (1 - p), over the answer's tokens and the two answers.
    assert logp.grad[0, 2].item() == pytest.approx(0.8 / 0.2 / 3 / 2, rel=1e-4)
    assert logp.grad[1, 1].item() == pytest.approx(0.6 / 0.4 / 2 / 2, rel=1e-4)
    assert logp.grad[0, 0].item() == logp.grad[0, 1].item() == logp.grad[1, 2].item() == 0.0
    # A token the policy is certain of stays finite.
    sure = unlikelihood(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    assert math.isfinite(sure.item()) and sure.item() > 10


def test_next_token_entropy_is_minus_sum_p_log_p():
    logits = torch.tensor([[2.0, 0.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0], [30.0, 0.0, 0.0, 0.0]])
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    p = torch.softmax(logits, dim=-1)
    want = -(p * torch.log(p)).sum(-1)
    got = next_token_entropy(logits, lse)
    assert torch.allclose(got, want, atol=1e-6)
    assert got[1].item() == pytest.approx(math.log(4), rel=1e-6) and got[2].item() < 1e-9 + 1e-6


def test_entropy_excess_sharpens_only_where_the_policy_became_flatter_than_the_base():
    base = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    new = _leaf([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # row 0 flatter than the base's, row 1 sharper
    h_ref = next_token_entropy(base, torch.logsumexp(base, -1, keepdim=True))
    excess = entropy_excess(next_token_entropy(new, torch.logsumexp(new, -1, keepdim=True)), h_ref)
    assert excess[0].item() > 0.2 and excess[1].item() == 0.0
    excess.sum().backward()
    # Descending the gradient raises the likeliest token's logit where the policy is too flat, and
    # leaves the position that is sharper than the base's alone.
    assert new.grad[0, 0].item() < 0 < new.grad[0, 1].item()
    assert torch.equal(new.grad[1], torch.zeros(3))
    # At the base's own distribution: zero, with zero gradient.
    same = _leaf(base.tolist())
    at_base = entropy_excess(next_token_entropy(same, torch.logsumexp(same, -1, keepdim=True)), h_ref)
    at_base.sum().backward()
    assert at_base.abs().max().item() < 1e-6 and same.grad.abs().max().item() < 1e-6


def _leaf(values):
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_token_filter_drops_gradient_outside_band():
    beh = torch.full((1, 3), LN(0.5))
    new = _leaf([[LN(0.5 * 0.4), LN(0.5 * 1.0), LN(0.5 * 2.5)]])  # ratios 0.4, 1.0, 2.5
    out = mispo_loss(new, beh, new.detach(), torch.ones(1, 3), torch.tensor([1.0]), seq_band=WIDE, beta=0.0)
    out.loss.backward()
    assert out.accepted_token_frac == pytest.approx(1 / 3)
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 2].item() == 0.0  # exactly zero, not small
    # Kept token: d/dnew of -ratio * A / n_tokens = -ratio * A / 3 = -1/3.
    assert new.grad[0, 1].item() == pytest.approx(-1 / 3)
    assert out.loss.item() == pytest.approx(-1 / 3)


def test_sequence_filter_drops_sequences_outside_band():
    beh = torch.zeros(2, 2)
    new = _leaf([[0.0, 0.0], [0.1, 0.1]])  # rho = 1 and e^0.1 = 1.105
    adv = torch.tensor([1.0, 1.0])
    out = mispo_loss(new, beh, beh, torch.ones(2, 2), adv, seq_band=(0.9, 1.05), beta=0.0)
    out.loss.backward()
    assert out.accepted_seq_frac == 0.5
    assert out.accepted_token_frac == 1.0  # every token is inside the token band
    assert new.grad[1].tolist() == [0.0, 0.0]
    # Kept sequence: -ratio * A / n_tokens / B per token = -1 / 2 / 2.
    assert new.grad[0].tolist() == pytest.approx([-0.25, -0.25])
    # The dropped sequence still counts in the mean over sequences: (-1 + 0) / 2.
    assert out.loss.item() == pytest.approx(-0.5)
    wide = mispo_loss(new.detach(), beh, beh, torch.ones(2, 2), adv, seq_band=(0.9, 1.2), beta=0.0)
    assert wide.accepted_seq_frac == 1.0


def test_total_loss_on_hand_made_batch():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    logr = [[0.0, LN(1.5), LN(3.0)], [LN(0.8), LN(1.25), 50.0]]  # last entry is padding: ignored
    d = [[0.0, LN(2.0), LN(0.5)], [LN(2.0), 0.0, 100.0]]  # logp_ref - logp_new
    beh = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -50.0]])
    new = _leaf((beh + torch.tensor(logr)).tolist())
    ref = (new.detach() + torch.tensor(d)).requires_grad_(True)
    beh.requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    out = mispo_loss(new, beh, ref, mask, adv, seq_band=(0.5, 2.0), beta=0.1)
    # Policy: seq 0 keeps ratios 1 and 1.5 (3 is outside the token band), rho = exp(mean logr) = 1.65
    # is inside the sequence band: -(1 + 1.5) * 1 / 3. Seq 1: -(0.8 + 1.25) * -2 / 2 = 2.05.
    policy = (-(2.5 / 3) + 2.05) / 2
    kl = (0 + (2 - LN(2) - 1) + (0.5 + LN(2) - 1) + (2 - LN(2) - 1) + 0) / 5
    assert out.loss.item() == pytest.approx(policy + 0.1 * kl, rel=1e-5)
    assert out.mean_kl == pytest.approx(kl, rel=1e-5)
    assert out.n_tokens == 5
    assert out.accepted_token_frac == pytest.approx(0.8)
    assert out.accepted_seq_frac == 1.0
    out.loss.backward()
    g = new.grad
    # d kl / d new = 1 - exp(d); policy: -ratio * A / (n_tokens * B)
    assert g[0, 0].item() == pytest.approx(-1 / 6, rel=1e-5)
    assert g[0, 2].item() == pytest.approx(0.1 * (1 - 0.5) / 5, rel=1e-5)  # filtered: KL only
    assert g[1, 1].item() == pytest.approx(1.25 * 2 / 4 + 0.0, rel=1e-5)
    assert g[1, 2].item() == 0.0  # padding
    assert beh.grad is None and ref.grad is None  # only logp_new is differentiated


def test_a_dislike_fades_once_its_answer_is_less_likely_than_under_the_base():
    tau = 0.1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    ref = torch.full((4, 3), -1.0)
    # Mean per-token log-ratio to the base: -tau*ln3 (padding ignored), 0, +0.5 and -tau*ln3 again.
    new = ref + torch.tensor([[-tau * LN(3), -tau * LN(3), -50.0], [0.2, -0.2, 0.0], [0.5] * 3, [-tau * LN(3)] * 3])
    adv = torch.tensor([-1.0, -2.0, -1.0, 1.5])
    got = fade_negatives(new, ref, mask, adv, tau)
    # 2*sigmoid(-ln 3) = 2 * 1/4: half the push; at or above the base: the whole push (capped at 1);
    # a liked answer's pull is never faded, however far below the base its answer is.
    assert got.tolist() == pytest.approx([-0.5, -2.0, -1.0, 1.5])
    assert fade_negatives(new, ref, mask, adv, 0.0) is adv

    leaf = _leaf(new.tolist())
    faded = mispo_loss(leaf, new, ref, mask, adv, token_band=WIDE, seq_band=WIDE, beta=0.0, neg_fade=tau)
    faded.loss.backward()
    same = _leaf(new.tolist())
    mispo_loss(same, new, ref, mask, got, token_band=WIDE, seq_band=WIDE, beta=0.0).loss.backward()
    # The fade is a weight, not a term: no gradient flows through it.
    assert torch.allclose(leaf.grad, same.grad)


def test_zero_gradient_when_everything_is_filtered():
    beh = torch.zeros(2, 3)
    new = _leaf([[0.1, 0.2, 0.3], [-0.1, 0.0, 0.1]])
    out = mispo_loss(
        new, beh, new.detach(), torch.ones(2, 3), torch.tensor([1.0, -1.0]), seq_band=(2.0, 3.0), beta=0.5
    )
    out.loss.backward()
    assert out.accepted_seq_frac == 0.0
    assert out.loss.item() == 0.0
    assert torch.count_nonzero(new.grad).item() == 0


# ---- the benchmark's alternatives ------------------------------------------------------------------


def test_soft_loss_clips_pessimistically_and_weights_by_drift():
    from rlfleet.worker.objective import soft_loss

    # One sequence, two tokens; behaviour = ref = 0 so ratio = exp(new), drift = mean k3(new, 0).
    new = torch.tensor([[LN(1.5), LN(0.9)]], requires_grad=True)
    zeros = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    out = soft_loss(new, zeros, zeros, mask, torch.tensor([1.0]), clip_eps=0.2, drift_tau=0.1, beta=0.0)
    # A > 0: min(r*A, clip(r)*A) -> token 1: min(1.5, 1.2) = 1.2 (clipped, no gradient); token 2: 0.9.
    k3 = [math.exp(-LN(1.5)) + LN(1.5) - 1, math.exp(-LN(0.9)) + LN(0.9) - 1]
    weight = math.exp(-(sum(k3) / 2) / 0.1)
    assert out.loss.item() == pytest.approx(-(1.2 + 0.9) / 2 * weight, rel=1e-5)
    assert out.accepted_token_frac == pytest.approx(0.5) and out.accepted_seq_frac == pytest.approx(weight)
    out.loss.backward()
    assert new.grad[0, 0].item() == 0.0  # the clipped token passes no gradient
    assert new.grad[0, 1].item() == pytest.approx(-0.9 / 2 * weight, rel=1e-5)  # d(r)/d(logp) = r

    # A < 0: min picks the unclipped 1.5 * -1 for the first token (pessimistic), so it keeps gradient.
    new.grad = None
    out = soft_loss(new, zeros, zeros, mask, torch.tensor([-1.0]), clip_eps=0.2, drift_tau=0.1, beta=0.0)
    assert out.loss.item() == pytest.approx((1.5 + 0.9 * 1.0) / 2 * weight, rel=1e-5)
    out.loss.backward()
    assert new.grad[0, 0].item() == pytest.approx(1.5 / 2 * weight, rel=1e-5)


def test_reinforce_loss_is_advantage_weighted_log_likelihood():
    from rlfleet.worker.objective import reinforce_loss

    new = torch.tensor([[-1.0, -3.0, 0.0], [-2.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    far = torch.full((2, 3), 5.0)  # behaviour far away: no ratio, nothing is filtered
    out = reinforce_loss(new, far, far, mask, torch.tensor([1.0, -0.5]))
    # sequence 1: -(mean logp -2) * 1 = 2; sequence 2: -(-2) * -0.5 = -1; mean over sequences 0.5
    assert out.loss.item() == pytest.approx(0.5)
    assert out.accepted_token_frac == 1.0 and out.mean_kl > 0
    out.loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.25, 0.0, 0.0]]))


def test_loss_for_picks_the_configured_objective():
    from dataclasses import replace

    from rlfleet.worker.objective import loss_for
    from rlfleet.worker.presets import preset

    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    beh = torch.tensor([[-1.1, -2.0]])
    mask, adv = torch.ones(1, 2), torch.tensor([1.0])
    cfg = preset("balanced")
    expected = mispo_loss(new, beh, beh, mask, adv, seq_band=cfg.seq_band, beta=cfg.beta).loss.item()
    assert loss_for(cfg)(new, beh, beh, mask, adv).loss.item() == pytest.approx(expected)
    assert loss_for(replace(cfg, objective="reinforce"))(new, beh, beh, mask, adv).loss.item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="unknown objective"):
        loss_for(replace(cfg, objective="dpo"))


def test_run_check_judges_the_runs_own_drift_not_the_lineages():
    from rlfleet.worker.objective import run_check

    assert run_check(-0.1, 0.0, 0.4, 1.0) == (True, None)
    assert run_check(-0.1, 0.9, 1.6, 1.0) == (True, None)  # a far-travelled lineage takes a small step
    ok, reason = run_check(-0.1, 0.2, 1.3, 1.0)
    assert not ok and "from 0.200 to 1.300" in reason
    ok, reason = run_check(float("nan"), 0.0, 0.1, 1.0)
    assert not ok and "diverged" in reason
