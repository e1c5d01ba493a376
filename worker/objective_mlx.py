"""The MIS-PO loss over MLX arrays: the same formula as :mod:`objective` (see its docstring).

Only the pieces that touch per-token arrays live here; the advantage and the EMA baseline are
plain numbers (:mod:`rlfleet.worker.training.advantages`) shared by both backends. Statistics
come back as MLX scalars, not Python floats: the loss is evaluated inside ``mlx.nn.value_and_grad``,
where arrays cannot be read back yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


def k3_kl(logp_new: mx.array, logp_ref: mx.array) -> mx.array:
    """Per-token k3 estimator of KL(new || ref): ``exp(d) - d - 1`` with ``d = logp_ref - logp_new``."""
    d = logp_ref - logp_new
    return mx.exp(d) - d - 1.0


_TAIL_FLOOR = 1e-6  # as objective._TAIL_FLOOR
_P_CEILING = 1.0 - 1e-6  # as objective._P_CEILING


def top_k_kl(new_top: mx.array, ref_top: mx.array) -> mx.array:
    """Per-position KL(new || ref) over the reference's K likeliest tokens and a tail bin; equal to
    :func:`objective.top_k_kl` on the same inputs (``[..., K]`` log-probs -> ``[...]``)."""
    p_new = mx.exp(new_top)
    tail_new = mx.maximum(1.0 - p_new.sum(axis=-1), _TAIL_FLOOR)
    tail_ref = mx.maximum(1.0 - mx.exp(ref_top).sum(axis=-1), _TAIL_FLOOR)
    return (p_new * (new_top - ref_top)).sum(axis=-1) + tail_new * (mx.log(tail_new) - mx.log(tail_ref))


def hindsight_kl(student_top: mx.array, teacher_top: mx.array) -> mx.array:
    """Equal to :func:`objective.hindsight_kl` on the same inputs."""
    return top_k_kl(teacher_top, student_top)


def per_answer_mean(values: mx.array, weights: mx.array, n_rows: int) -> mx.array:
    """Equal to :func:`objective.per_answer_mean` on the same inputs."""
    return (weights * values).sum() / max(n_rows, 1)


def next_token_entropy(logits: mx.array, lse: mx.array) -> mx.array:
    """Equal to :func:`objective.next_token_entropy` on the same inputs."""
    p = mx.exp(logits - lse)
    return lse.squeeze(-1) - (p * logits).sum(axis=-1)


def entropy_excess(h_new: mx.array, h_ref: mx.array) -> mx.array:
    """Equal to :func:`objective.entropy_excess` on the same inputs."""
    rise = h_new - mx.stop_gradient(h_ref)
    return mx.where(rise > 0, rise, mx.zeros_like(rise))


def unlikelihood(logp_new: mx.array, mask: mx.array, marks: mx.array) -> mx.array:
    """Equal to :func:`objective.unlikelihood` on the same inputs."""
    hit = mask.astype(mx.bool_) & marks.astype(mx.bool_)
    p = mx.minimum(mx.exp(mx.where(hit, logp_new, mx.full(logp_new.shape, -30.0))), _P_CEILING)
    n = mx.maximum(mask.astype(mx.float32).sum(axis=1), 1.0)
    return (-(mx.log1p(-p) * hit.astype(p.dtype)).sum(axis=1) / n).mean()


def fade_negatives(logp_new: mx.array, logp_ref: mx.array, mask: mx.array, advantages: mx.array,
                   tau: float) -> mx.array:
    """Equal to :func:`objective.fade_negatives` on the same inputs (no gradient)."""
    if tau <= 0:
        return advantages
    mask_b = mask.astype(mx.bool_)
    d = mx.where(mask_b, mx.stop_gradient(logp_new) - logp_ref.astype(logp_new.dtype), mx.zeros_like(logp_new))
    d = d.sum(axis=1) / mx.maximum(mask_b.astype(d.dtype).sum(axis=1), 1.0)
    weight = mx.minimum(2.0 * mx.sigmoid(d / tau), 1.0).astype(advantages.dtype)
    return mx.stop_gradient(mx.where(advantages < 0, advantages * weight, advantages))


@dataclass(frozen=True)
class MlxLossOutput:
    loss: mx.array  # scalar, differentiable w.r.t. logp_new only
    accepted_tokens: mx.array  # response tokens whose ratio is inside token_band (a count)
    accepted_seqs: mx.array  # sequences whose rho is inside seq_band (a count)
    mean_kl: mx.array  # mean k3 KL per response token (all tokens, unfiltered)
    n_tokens: mx.array  # response tokens in the batch
    anchor_kl: mx.array  # the KL term's mean per response token (the k3 one without an anchor)

    def stats(self) -> dict[str, mx.array]:
        return {
            "accepted_tokens": self.accepted_tokens,
            "accepted_seqs": self.accepted_seqs,
            "mean_kl": self.mean_kl,
            "n_tokens": self.n_tokens,
            "anchor_kl": self.anchor_kl,
        }


def mispo_loss(
    logp_new: mx.array,
    logp_beh: mx.array,
    logp_ref: mx.array,
    mask: mx.array,
    advantages: mx.array,
    *,
    token_band: tuple[float, float] = (0.5, 2.0),
    seq_band: tuple[float, float],
    beta: float,
    anchor: mx.array | None = None,
    neg_fade: float = 0.0,
) -> MlxLossOutput:
    """The loss of one (micro-)batch, equal to :func:`objective.mispo_loss` on the same inputs.

    Shapes: ``logp_*`` and ``mask`` are ``[B, T]`` (``mask`` true on response tokens); ``advantages``
    is ``[B]``. Values of ``logp_*`` off the mask are ignored; ``anchor`` as in the torch loss.
    """
    mask_b = mask.astype(mx.bool_)
    dtype = logp_new.dtype
    maskf = mask_b.astype(dtype)
    # Only logp_new carries gradient: the others are fixed targets of this run.
    logp_beh = mx.stop_gradient(logp_beh.astype(dtype))
    logp_ref = mx.stop_gradient(logp_ref.astype(dtype))
    adv = fade_negatives(logp_new, logp_ref, mask_b, mx.stop_gradient(advantages.astype(dtype)), neg_fade)

    # Zero off the mask before exp(): padding may hold anything, and inf * 0 would poison the sum.
    zeros = mx.zeros_like(logp_new)
    logr = mx.where(mask_b, logp_new - logp_beh, zeros)
    ratio = mx.exp(logr)
    sg_ratio, sg_logr = mx.stop_gradient(ratio), mx.stop_gradient(logr)
    tok_keep = mask_b & (sg_ratio >= token_band[0]) & (sg_ratio <= token_band[1])
    n_seq_tokens = maskf.sum(axis=1)
    denom = mx.maximum(n_seq_tokens, 1.0)
    rho = mx.exp(sg_logr.sum(axis=1) / denom)
    seq_keep = (rho >= seq_band[0]) & (rho <= seq_band[1])
    keep = mx.stop_gradient((tok_keep & seq_keep[:, None]).astype(dtype))

    per_seq = -(keep * ratio).sum(axis=1) * adv / denom
    policy = per_seq.mean()

    n_tokens = maskf.sum()
    kl = k3_kl(mx.where(mask_b, logp_new, zeros), mx.where(mask_b, logp_ref, zeros))
    kl_mean = (kl * maskf).sum() / mx.maximum(n_tokens, 1.0)
    anchor_mean = kl_mean if anchor is None else (mx.where(mask_b, anchor, zeros) * maskf).sum() / mx.maximum(
        n_tokens, 1.0
    )

    return MlxLossOutput(
        loss=policy + beta * anchor_mean,
        accepted_tokens=tok_keep.astype(mx.float32).sum(),
        accepted_seqs=seq_keep.astype(mx.float32).sum(),
        mean_kl=mx.stop_gradient(kl_mean),
        n_tokens=n_tokens,
        anchor_kl=mx.stop_gradient(anchor_mean),
    )
