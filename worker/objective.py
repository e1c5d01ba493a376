"""The training objective (docs/objective.md): pure functions over tensors, no I/O, no model.

One rated response is one rollout with reward ``r`` (+1 good, -1 bad). Three policies appear:
``ref`` (the base, adapter disabled: the KL anchor), ``beh`` (the policy that produced the answer)
and ``new`` (the policy being trained). Per response token ``t`` of a sequence::

    logr_t  = logp_new(t) - logp_beh(t)
    ratio_t = exp(logr_t)                                  token kept iff ratio_t in token_band
    rho     = exp(mean_t logr_t)                           sequence kept iff rho in seq_band
    kl_t    = exp(logp_ref - logp_new) - (logp_ref - logp_new) - 1      (k3 estimator, >= 0)

    loss = mean_over_sequences[ -sum_t(keep_t * ratio_t * A) / n_tokens ] + beta * mean_t(kl_t)

With ``kl_top_k = K > 0`` the anchor ``kl_t`` is instead the KL of the whole next-token distribution
at ``t`` over the base's K likeliest tokens and one bin for the rest (:func:`top_k_kl`): the k3
estimate sees only the answer's own token, so mass a 👎 pushes off it may land anywhere else unseen.

With ``neg_fade = tau > 0`` a 👎's advantage is multiplied by ``min(1, 2 * sigmoid(d / tau))``, ``d``
the answer's mean per-token ``logp_new - logp_ref`` (:func:`fade_negatives`): full while the answer is
at least as likely as under the base, fading once the run has pushed it below.

``n_tokens`` is the sequence's own number of response tokens (filtered tokens still count, so a
filter only ever removes gradient, never rescales the rest); a dropped sequence contributes zero
but still counts in the mean over sequences, so a band that drops most of a batch visibly shrinks
the update instead of concentrating it on the few survivors. The KL mean runs over every response
token of the batch, unfiltered: the anchor holds even where the policy term is switched off.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# The advantage rule and the reward baseline are plain numbers, shared by every backend.
from .training.advantages import advantage
from .training.advantages import update_ema as update_ema


def advantages(rewards: Tensor, ema: float, pos_weight: float, clip: float = 2.0) -> Tensor:
    """:func:`rlfleet.worker.training.advantages.advantage` of each reward, as a float32 tensor."""
    values = [advantage(float(r), ema, pos_weight, clip) for r in rewards.tolist()]
    return torch.tensor(values, dtype=torch.float32, device=rewards.device)


def k3_kl(logp_new: Tensor, logp_ref: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(new || ref): ``exp(d) - d - 1`` with ``d = logp_ref - logp_new``.

    Unbiased for samples drawn from ``new``, always >= 0, and zero with zero gradient at ``new = ref``.
    """
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1.0


_TAIL_FLOOR = 1e-6  # the tail bin's probability, floored: fp32 rounding can take 1 - sum(p) to 0 or below


def top_k_kl(new_top: Tensor, ref_top: Tensor) -> Tensor:
    """Per-position KL(new || ref) over ``K + 1`` bins: the reference's K likeliest tokens and the
    rest of the vocabulary as one tail bin.

    ``new_top`` and ``ref_top`` are ``[..., K]`` log-probs of the same K tokens under each model (the
    full log-softmax at those tokens, so each row sums to at most 1 in probability). A lower bound of
    the full KL (merging bins never raises a KL), exact when the K tokens hold all of both models'
    mass; zero with zero gradient at ``new = ref``.
    """
    p_new = new_top.exp()
    tail_new = (1.0 - p_new.sum(-1)).clamp(min=_TAIL_FLOOR)
    tail_ref = (1.0 - ref_top.exp().sum(-1)).clamp(min=_TAIL_FLOOR)
    return (p_new * (new_top - ref_top)).sum(-1) + tail_new * (tail_new.log() - tail_ref.log())


def hindsight_kl(student_top: Tensor, teacher_top: Tensor) -> Tensor:
    """Per-position KL(teacher || student) over ``K + 1`` bins: the teacher's K likeliest tokens and
    the rest of the vocabulary as one tail bin (:func:`top_k_kl` with the teacher as the first
    distribution). ``[..., K]`` log-probs of the same tokens under each model -> ``[...]``.

    The hindsight teacher (docs/objective.md, "Hindsight") is the model reading the user's words on
    the answer; this pulls the student's whole next-token distribution toward the teacher's at every
    position of the student's own answer. The forward direction covers the teacher's mass: tokens the
    teacher prefers get probability even where the student never sampled them, which a 👎 alone, or
    an advantage on the sampled token, cannot give them. Zero, with zero gradient, at student = teacher.
    """
    return top_k_kl(teacher_top, student_top)


def per_answer_mean(values: Tensor, weights: Tensor, n_rows: int) -> Tensor:
    """``sum(weights * values) / n_rows``: with each taught answer's positions weighted ``1 / its
    length`` (0 elsewhere), every answer weighs the same whatever its length, and an answer without a
    teacher still counts in the mean over the micro-batch's answers, as in :func:`mispo_loss`."""
    return (weights * values).sum() / max(n_rows, 1)


def next_token_entropy(logits: Tensor, lse: Tensor) -> Tensor:
    """The entropy of each next-token distribution, ``[..., V]`` logits and their ``[..., 1]``
    logsumexp -> ``[...]``: ``lse - sum(p * logits)``, which equals ``-sum(p * log p)``."""
    p = (logits - lse).exp()
    return lse.squeeze(-1) - (p * logits).sum(-1)


def entropy_excess(h_new: Tensor, h_ref: Tensor) -> Tensor:
    """Per position, how far the trained policy's next-token entropy rose above the base's:
    ``max(0, h_new - h_ref)``. Weighted into the loss (``train.entropy_hinge``) it sharpens a
    distribution only where it became flatter than the base's: a 👎 pushes probability off its token,
    and this sends it to the likeliest other tokens instead of spreading it over the vocabulary, where
    a small model starts to ramble and loop (arXiv 2505.22617 on why negative pushes raise entropy).
    Zero, with zero gradient, wherever the policy is at least as sure as the base."""
    rise = h_new - h_ref.detach()
    return torch.where(rise > 0, rise, torch.zeros_like(rise))  # clamp's gradient at 0 would be 1


def fade_negatives(logp_new: Tensor, logp_ref: Tensor, mask: Tensor, advantages: Tensor, tau: float) -> Tensor:
    """The advantages with each negative one times ``min(1, 2 * sigmoid(d / tau))``, ``d`` its answer's
    mean per-token log-ratio of the trained policy to the base (no gradient); ``[B, T]`` log-probs and
    mask, ``[B]`` advantages -> ``[B]``. ``tau`` <= 0: unchanged.

    A 👎 says "not this answer", not "anything but this": once the answer has become less likely than
    the base made it, pushing further only spreads its probability over whatever else the model finds
    plausible, which is how the entropy rises and a small model starts to loop (arXiv 2505.22617).
    KTO's sigmoid saturates the same way (arXiv 2402.01306); a liked answer's pull is left as it is."""
    if tau <= 0:
        return advantages
    with torch.no_grad():
        mask_b = mask.bool()
        d = torch.where(mask_b, logp_new - logp_ref.to(logp_new.dtype), torch.zeros_like(logp_new))
        d = d.sum(dim=1) / mask_b.sum(dim=1).clamp(min=1)
        weight = (2.0 * torch.sigmoid(d / tau)).clamp(max=1.0).to(advantages.dtype)
        return torch.where(advantages < 0, advantages * weight, advantages)


@dataclass
class LossOutput:
    loss: Tensor  # scalar, differentiable w.r.t. logp_new only
    accepted_token_frac: float  # response tokens whose ratio is inside token_band
    accepted_seq_frac: float  # sequences whose rho is inside seq_band
    mean_kl: float  # mean k3 KL per response token (all tokens, unfiltered)
    n_tokens: int  # response tokens in the batch
    anchor_kl: float | None = None  # the KL term's own mean per response token, where it is not the k3 one


def mispo_loss(
    logp_new: Tensor,
    logp_beh: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    advantages: Tensor,
    *,
    token_band: tuple[float, float] = (0.5, 2.0),
    seq_band: tuple[float, float],
    beta: float,
    anchor: Tensor | None = None,
    neg_fade: float = 0.0,
) -> LossOutput:
    """The loss of one (micro-)batch; see the module docstring for the formula.

    Shapes: ``logp_*`` and ``mask`` are ``[B, T]`` (``mask`` = 1 on response tokens, 0 on prompt and
    padding); ``advantages`` is ``[B]``. Values of ``logp_*`` off the mask are ignored. ``anchor``,
    ``[B, T]`` with gradient: a per-token KL to the base to weight by ``beta`` in place of the k3
    estimate (:func:`top_k_kl`); ``mean_kl`` reports the k3 estimate either way.
    """
    mask_b = mask.bool()
    maskf = mask_b.to(logp_new.dtype)
    # Only logp_new carries gradient: the others are fixed targets of this run.
    logp_beh = logp_beh.detach().to(logp_new.dtype)
    logp_ref = logp_ref.detach().to(logp_new.dtype)
    adv = fade_negatives(logp_new.detach(), logp_ref, mask_b, advantages.detach().to(logp_new.dtype), neg_fade)

    # Zero off the mask before exp(): padding may hold anything, and inf * 0 would poison the sum.
    zeros = torch.zeros_like(logp_new)
    logr = torch.where(mask_b, logp_new - logp_beh, zeros)
    ratio = torch.exp(logr)
    with torch.no_grad():
        tok_keep = mask_b & (ratio >= token_band[0]) & (ratio <= token_band[1])
        n_seq_tokens = maskf.sum(dim=1)
        rho = torch.exp(logr.sum(dim=1) / n_seq_tokens.clamp(min=1))
        seq_keep = (rho >= seq_band[0]) & (rho <= seq_band[1])
        keep = tok_keep & seq_keep[:, None]

    per_seq = -(keep.to(ratio.dtype) * ratio).sum(dim=1) * adv / n_seq_tokens.clamp(min=1)
    policy = per_seq.mean()

    n_tokens = int(mask_b.sum().item())
    kl = k3_kl(torch.where(mask_b, logp_new, zeros), torch.where(mask_b, logp_ref, zeros))
    kl_mean = (kl * maskf).sum() / max(n_tokens, 1)

    anchor_mean = _anchor_mean(anchor, kl_mean, mask_b, n_tokens)
    return LossOutput(
        loss=policy + beta * anchor_mean,
        accepted_token_frac=float(tok_keep.sum().item()) / max(n_tokens, 1),
        accepted_seq_frac=float(seq_keep.float().mean().item()) if seq_keep.numel() else 0.0,
        mean_kl=float(kl_mean.detach().item()),
        n_tokens=n_tokens,
        anchor_kl=None if anchor is None else float(anchor_mean.detach().item()),
    )


_P_CEILING = 1.0 - 1e-6  # keeps -log(1 - p) finite where the policy is certain of a looping token


def unlikelihood(logp_new: Tensor, mask: Tensor, marks: Tensor) -> Tensor:
    """Sequence-level unlikelihood (arXiv 1908.04319) on the marked tokens of the policy's own
    answers: per answer ``sum_marked -log(1 - p_t) / n_tokens`` (its response tokens), the mean over
    answers. ``logp_new``, ``mask`` and ``marks`` are ``[B, T]``; a marked token off the mask is ignored.

    Its gradient on a marked token's logit is ``p_t``: a token the policy repeats with certainty is
    pushed hardest, one it barely considers hardly at all.
    """
    mask_b = mask.bool()
    hit = mask_b & marks.bool()
    p = torch.where(hit, logp_new, torch.full_like(logp_new, -30.0)).exp().clamp(max=_P_CEILING)
    per_seq = -(torch.log1p(-p) * hit.to(p.dtype)).sum(dim=1) / mask_b.sum(dim=1).clamp(min=1)
    return per_seq.mean()


def _anchor_mean(anchor: Tensor | None, k3_mean: Tensor, mask_b: Tensor, n_tokens: int) -> Tensor:
    """The KL term's mean per response token: ``anchor``'s where given, else the k3 estimate's."""
    if anchor is None:
        return k3_mean
    return torch.where(mask_b, anchor, torch.zeros_like(anchor)).sum() / max(n_tokens, 1)


def run_check(loss: float, start_kl: float, final_kl: float, max_run_kl: float) -> tuple[bool, str | None]:
    """A run's own sanity check: finite, and it moved the policy by at most ``max_run_kl`` of mean
    per-token KL to the base (measured from where the run started, so a lineage that has learned a
    lot can still take its next step)."""
    if not all(math.isfinite(x) for x in (loss, start_kl, final_kl)):
        return False, f"training diverged: loss {loss}, mean KL {final_kl}"
    if final_kl - start_kl > max_run_kl:
        return False, (f"this run moved the mean KL to the base from {start_kl:.3f} to {final_kl:.3f} "
                       f"(more than {max_run_kl})")
    return True, None


# ---- alternatives, for the learning benchmark's comparison (bench/learning) -----------------------


def _masked(logp_new: Tensor, logp_beh: Tensor, logp_ref: Tensor, mask: Tensor, advantages: Tensor):
    mask_b = mask.bool()
    zeros = torch.zeros_like(logp_new)
    beh = torch.where(mask_b, logp_beh.detach().to(logp_new.dtype), zeros)
    ref = torch.where(mask_b, logp_ref.detach().to(logp_new.dtype), zeros)
    new = torch.where(mask_b, logp_new, zeros)
    n_seq = mask_b.sum(dim=1).to(logp_new.dtype).clamp(min=1)
    return mask_b, new, beh, ref, n_seq, advantages.detach().to(logp_new.dtype)


def soft_loss(
    logp_new: Tensor,
    logp_beh: Tensor,
    logp_ref: Tensor,
    mask: Tensor,
    advantages: Tensor,
    *,
    clip_eps: float = 0.2,
    drift_tau: float = 0.05,
    beta: float,
    anchor: Tensor | None = None,
) -> LossOutput:
    """A ReinforceClaw-style soft objective: PPO's pessimistic clipped surrogate per token, each
    sequence weighted by ``exp(-drift / drift_tau)`` where ``drift`` is its mean k3 KL to the base
    (soft: a sequence that drifted is down-weighted, not dropped), plus ``beta`` * KL (``anchor``'s
    where given, as in :func:`mispo_loss`).

    accepted_token_frac = tokens whose ratio is inside the clip range; accepted_seq_frac = the mean
    sequence weight.
    """
    mask_b, new, beh, ref, n_seq, adv = _masked(logp_new, logp_beh, logp_ref, mask, advantages)
    maskf = mask_b.to(new.dtype)
    ratio = torch.exp(new - beh)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    kl = k3_kl(new, ref) * maskf
    with torch.no_grad():
        weight = torch.exp(-(kl.sum(dim=1) / n_seq) / drift_tau)
        inside = mask_b & (ratio >= 1 - clip_eps) & (ratio <= 1 + clip_eps)
    policy = (-(surrogate * maskf).sum(dim=1) / n_seq * weight).mean()
    n_tokens = int(mask_b.sum().item())
    kl_mean = kl.sum() / max(n_tokens, 1)
    anchor_mean = _anchor_mean(anchor, kl_mean, mask_b, n_tokens)
    return LossOutput(
        loss=policy + beta * anchor_mean,
        accepted_token_frac=float(inside.sum().item()) / max(n_tokens, 1),
        accepted_seq_frac=float(weight.mean().item()) if weight.numel() else 0.0,
        mean_kl=float(kl_mean.detach().item()),
        n_tokens=n_tokens,
        anchor_kl=None if anchor is None else float(anchor_mean.detach().item()),
    )


def reinforce_loss(
    logp_new: Tensor, logp_beh: Tensor, logp_ref: Tensor, mask: Tensor, advantages: Tensor, anchor: Tensor | None = None
) -> LossOutput:
    """Plain REINFORCE with the EMA baseline: ``-A * mean_t logp_new``; no ratio, filter or KL term
    (the KL is still measured and reported; ``anchor`` is ignored)."""
    mask_b, new, _beh, ref, n_seq, adv = _masked(logp_new, logp_beh, logp_ref, mask, advantages)
    maskf = mask_b.to(new.dtype)
    policy = (-(new * maskf).sum(dim=1) / n_seq * adv).mean()
    n_tokens = int(mask_b.sum().item())
    with torch.no_grad():
        kl_mean = float((k3_kl(new, ref) * maskf).sum().item()) / max(n_tokens, 1)
    return LossOutput(loss=policy, accepted_token_frac=1.0, accepted_seq_frac=1.0, mean_kl=kl_mean,
                      n_tokens=n_tokens)


OBJECTIVES = ("mispo", "soft", "reinforce")


def loss_for(cfg: Any) -> Callable[..., LossOutput]:
    """The loss named by ``cfg.objective``, with that config's knobs bound: called with ``logp_new,
    logp_beh, logp_ref, mask, advantages`` and optionally ``anchor``."""
    name = getattr(cfg, "objective", "mispo")
    if name == "mispo":
        return lambda *t, anchor=None: mispo_loss(
            *t, token_band=cfg.token_band, seq_band=cfg.seq_band, beta=cfg.beta, anchor=anchor,
            neg_fade=getattr(cfg, "neg_fade", 0.0),
        )
    if name == "soft":
        return lambda *t, anchor=None: soft_loss(
            *t, clip_eps=cfg.clip_eps, drift_tau=cfg.drift_tau, beta=cfg.beta, anchor=anchor
        )
    if name == "reinforce":
        return reinforce_loss
    raise ValueError(f"unknown objective {name!r} (known: {', '.join(OBJECTIVES)})")
