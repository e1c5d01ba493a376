"""The token log-prob with one backward pass over the vocabulary (worker/training/token_logprobs.py):
autograd's values and gradients bit for bit, with fewer vocabulary-wide tensors in the backward."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from rlfleet.worker.training.token_logprobs import token_logprobs

N, V = 37, 3001


def _plain(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return (logits.gather(-1, targets[:, None]) - lse).squeeze(-1), lse


def _grads(fn, logits: torch.Tensor, targets: torch.Tensor, use_lp: bool, use_lse: bool):
    x = logits.detach().clone().requires_grad_(True)
    lp, lse = fn(x, targets)
    gen = torch.Generator().manual_seed(1)
    loss = torch.zeros(())
    if use_lp:
        loss = loss + (lp * torch.randn(N, generator=gen)).sum()
    if use_lse:  # another reader of the logsumexp (the top-k anchor, the hindsight term)
        loss = loss + (lse * torch.randn(N, 1, generator=gen)).sum()
    loss.backward()
    return lp.detach(), lse.detach(), x.grad


@pytest.mark.parametrize(("use_lp", "use_lse"), [(True, False), (True, True), (False, True)])
def test_values_and_gradients_are_autograds_bit_for_bit(use_lp, use_lse):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=gen) * 4
    targets = torch.randint(0, V, (N,), generator=gen)
    ours = _grads(token_logprobs, logits, targets, use_lp, use_lse)
    plain = _grads(_plain, logits, targets, use_lp, use_lse)
    assert all(torch.equal(a, b) for a, b in zip(ours, plain, strict=True))
    assert float(ours[2].abs().sum()) > 0


def test_without_gradients_it_is_the_plain_computation():
    logits = torch.randn(N, V) * 4
    targets = torch.randint(0, V, (N,))
    with torch.no_grad():
        lp, lse = token_logprobs(logits, targets)
    assert all(torch.equal(a, b) for a, b in zip((lp, lse), _plain(logits, targets), strict=True))


def _wide_ops_in_backward(fn) -> int:
    """How many ops of the backward touch a vocabulary-wide tensor."""
    logits = (torch.randn(N, V) * 4).requires_grad_(True)
    lp, _lse = fn(logits, torch.randint(0, V, (N,)))
    loss = lp.sum()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        loss.backward()
    return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key.startswith("aten::") and any(V in (s or []) for s in e.input_shapes))


def test_its_backward_makes_fewer_passes_over_the_vocabulary():
    ours, plain = _wide_ops_in_backward(token_logprobs), _wide_ops_in_backward(_plain)
    assert 0 < ours < plain, (ours, plain)
