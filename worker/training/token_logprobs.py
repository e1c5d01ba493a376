"""Each answer token's log-prob and its position's logsumexp from vocabulary-wide logits, with one
backward pass over the vocabulary.

Autograd's own graph for ``logits.gather(targets) - logsumexp(logits)`` makes, in its backward,
logsumexp's gradient (a subtraction, an exponential and a product, each a fresh ``[N, V]`` tensor),
the gather's (a zero ``[N, V]`` tensor and a scatter) and their sum (another): on a CPU that
vocabulary-wide elementwise work is a fifth of a training step (bench/RESULTS.md, ``bench.train_step
--profile``). The gradient is ``p · g_lse − p · g_lp + onehot · g_lp`` with ``p = exp(logits − lse)``:
one new tensor, scaled in place, the token's gradient added at its index. The values are autograd's,
bit for bit: the same ``p``, the same products and sums.
"""

from __future__ import annotations

from typing import Any

import torch


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        lp = (logits.gather(-1, targets[:, None]) - lse).squeeze(-1)
        ctx.save_for_backward(logits, lse, targets)
        ctx.set_materialize_grads(False)
        return lp, lse

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor | None, grad_lse: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, None]:
        logits, lse, targets = ctx.saved_tensors
        # What reaches the logsumexp: the log-prob's -g_lp and whatever else read lse.
        if grad_lp is None:
            if grad_lse is None:
                return None, None
            into_lse = grad_lse
        else:
            into_lse = -grad_lp[:, None] if grad_lse is None else grad_lse - grad_lp[:, None]
        grad = torch.sub(logits, lse).exp_().mul_(into_lse)
        if grad_lp is not None:
            grad.scatter_add_(-1, targets[:, None], grad_lp[:, None])
        return grad, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, V]`` logits and ``[N]`` target ids -> each target's ``[N]`` log-prob and the ``[N, 1]``
    logsumexp; differentiable in the logits through both."""
    return _TokenLogprobs.apply(logits, targets)
