"""Attention for bf16 training passes on a CPU: the query heads that share a key/value head stacked
into one matrix product, instead of SDPA's fused kernel.

On a CPU, torch's fused (flash) attention runs a training pass's short rows (a few hundred tokens,
64-wide heads) well below the matrix-product rate, and gains nothing from causality there (a causal
call costs what a fully masked one does). Grouped-query models (several query heads per key/value
head) let the heads of a group share their keys: stacked, a group's queries are one
``[G·Lq, D] × [D, Lk]`` bf16 product per key/value head, and the probabilities one more with the
values; the scores are at most :data:`MAX_SCORES` elements, so the softmax in between stays cheap.
It is taken in fp32, and only its bf16 probabilities are kept for the backward. Anything else (a
GPU, fp32, one query at a time, dropout, a soft cap, a position bias, scores beyond the cap) goes to
transformers' own SDPA function, so a pass never depends on this path to be right. How much it
buys: bench/RESULTS.md, ``bench.train_step`` (``ours`` against ``ours-sdpa``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

NAME = "rlfleet_grouped"
# Scores of one layer's pass, in elements: a pass keeps 2 bytes of each for its backward (the bf16
# probabilities), so a CPU micro-batch (512 tokens: about 1.6 M scores on the default model) costs
# some 3 MB a layer; rows longer than the cap go to SDPA, whose fused kernel keeps none.
MAX_SCORES = 4 * 2**20


def bf16_pass(query: Tensor) -> bool:
    """Whether this call's products are bf16: its query is, or a CPU bf16 autocast is on (the rotary
    embedding leaves fp32 queries and keys there; SDPA would cast them down, as this path does)."""
    return query.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)


def applies(query: Tensor, key: Tensor, dropout: float, kwargs: dict[str, Any]) -> bool:
    """Whether the stacked product serves this call (else SDPA does)."""
    b, h, lq, _ = query.shape
    return (
        query.device.type == "cpu"
        and bf16_pass(query)
        and lq > 1
        and h % key.shape[1] == 0
        and dropout == 0.0
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and kwargs.get("s_aux") is None
        and not kwargs.get("output_attentions", False)
        and b * h * lq * key.shape[2] <= MAX_SCORES
    )


def grouped_attention(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scaling: float, is_causal: bool
) -> Tensor:
    """``[B, H, Lq, D]`` queries over ``[B, KV, Lk, D]`` keys and values -> ``[B, Lq, H, D]``.

    ``mask``: ``[B or 1, 1, Lq, Lk]``, True where a query may read a key (or an additive float mask);
    None with ``is_causal``: each query reads the keys up to its own position, aligned at the top left
    as SDPA aligns them. A query that may read no key reads all of them evenly (finite, as an eager
    pass gives), where SDPA's math would give NaN: such rows are padding, masked out downstream."""
    b, h, lq, d = query.shape
    kv, lk = key.shape[1], key.shape[2]
    g = h // kv
    query, key, value = (t.to(torch.bfloat16) for t in (query, key, value))
    if mask is None and is_causal:
        lk = min(lk, lq)
        key, value = key[:, :, :lk], value[:, :, :lk]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril()[None, None]
    if scaling != 1.0:
        # On the queries, as SDPA's math path puts it: Lk/D times fewer elements than the scores, and
        # exact where the scale is a power of two (1/8 for 64-wide heads).
        query = query * scaling
    scores = torch.matmul(query.reshape(b, kv, g * lq, d), key.transpose(-1, -2)).view(b, kv, g, lq, lk)
    probs = _Softmax.apply(scores, None if mask is None else mask[:, :, None])
    out = torch.matmul(probs.view(b, kv, g * lq, lk), value).view(b, h, lq, d)
    return out.transpose(1, 2).contiguous()


class _Softmax(torch.autograd.Function):
    """bf16 scores -> bf16 probabilities, masked and normalised by torch's own softmax kernel on the
    bf16 scores (fp32 inside, one pass and no fp32 copy of them), keeping only the bf16 probabilities
    for the backward (which the next product keeps anyway): autograd's own graph would keep the mask
    too. The gradient is softmax's, ``p · (g − Σ g·p)``, by torch's backward kernel on the bf16
    probabilities and gradient (fp32 inside, one pass). The scale is on the queries
    (:func:`grouped_attention`), so neither pass multiplies the scores."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor, mask: Tensor | None) -> Tensor:
        if mask is None:
            x = scores
        elif mask.dtype == torch.bool:
            x = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:  # an additive mask (rare): added in its own precision, as SDPA adds it
            x = scores.float() + mask
        probs = torch.softmax(x, dim=-1).to(scores.dtype)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (probs,) = ctx.saved_tensors
        return torch.ops.aten._softmax_backward_data(grad.to(probs.dtype), probs, -1, probs.dtype), None


def attention_forward(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature: the stacked product where :func:`applies`, else
    transformers' SDPA function with the same arguments."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not applies(query, key, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return grouped_attention(query, key, value, attention_mask, scale, bool(causal) and query.shape[2] > 1), None


def register() -> str:
    """Make :data:`NAME` an attention implementation transformers knows (with SDPA's masks); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def use_on(model: Any, device: str) -> bool:
    """Switch a CPU ``model`` that attends with SDPA to :data:`NAME` (which hands every call it does not
    serve back to SDPA). Any other device or attention implementation is left as it is; so is a model
    that refuses the switch. Whether it switched."""
    if device.split(":")[0] != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(register())
    except (ValueError, TypeError, AttributeError, ImportError):
        return False
    return getattr(model.config, "_attn_implementation", None) == NAME


def used_by(model: Any, precision: str) -> str | None:
    """The attention a ``model``'s passes at ``precision`` go through: :data:`NAME` hands fp32 ones to SDPA."""
    name = getattr(model.config, "_attn_implementation", None)
    return "sdpa" if name == NAME and precision != "bf16" else name


def custom_masks(model: Any) -> bool:
    """Whether ``model``'s attention takes a 4-D boolean mask as it is (SDPA's, or :data:`NAME`)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", NAME)
