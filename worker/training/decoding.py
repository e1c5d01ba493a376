"""Answers drawn by the trainer's own model, batched, each row with its own random stream.

A run samples answers at three points (:mod:`.drawing`). Where llama.cpp does not draw them
(``chat.engine = "torch"``, a GPU, a model that is no GGUF file, an adapter llama.cpp refuses) the
trainer's model does, here, in bf16 where that is native (whatever the run trains in). What this adds
over transformers' ``generate`` (bench/RESULTS.md, ``bench.draw``):

* each row samples from a random stream of its own (``seeds``), so an answer is the same in whichever
  batch it is drawn (the gate remembers the base's answers per prompt: ``scoring.draw_held``), as
  llama.cpp's per-sequence samplers do: exactly in fp32; in bf16 up to the products' rounding, which
  moves a little with the batch's padding, so a row drawn in another batch can part ways after a few
  tokens (still a draw from the same model: the gate's base answers read ahead stay valid samples);
* a row leaves the batch as it ends (its keys and values are dropped from the cache), where
  ``generate`` computes every row to the longest;
* top-p over the few likeliest tokens, not a sort of the whole vocabulary per row and step, exactly:
  a row whose nucleus reaches past them is sorted whole (:func:`pick`).

A decoding step multiplies only a few rows by each weight matrix, so its fixed cost per layer weighs
on a small batch: on a CPU llama.cpp's batch stays the faster for a run's draws (``chat.engine``
auto). The model's forward is the caller's business (its precision, its adapter): :func:`draw` takes
the model's body and its output head's weight and runs them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

# The likeliest tokens pick sorts first; a row whose top-p nucleus holds more is sorted whole.
TOP = 64


def pick(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor) -> torch.Tensor:
    """The next token of each row of ``[B, V]`` fp32 ``logits``: the likeliest at ``temperature`` 0,
    else drawn from the softmax at ``temperature`` restricted to its top-p nucleus (the fewest
    likeliest tokens whose probability reaches ``top_p``, at least one; transformers' and llama.cpp's
    rule), by inverting its distribution at each row's uniform draw in ``uniforms`` ``[B]``."""
    if temperature <= 0:
        return logits.argmax(-1)
    vocab = logits.shape[-1]
    scaled = logits / temperature
    k = min(TOP, vocab) if top_p < 1 else vocab
    # The likeliest k by their logits, their probabilities from the row's logsumexp: the vocabulary is
    # read twice (top-k, logsumexp), never written as probabilities.
    top, ids = scaled.topk(k, dim=-1) if k < vocab else scaled.sort(dim=-1, descending=True)
    lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
    top = (top - lse).exp()
    if k < vocab:
        short = top.sum(-1) < top_p  # the nucleus reaches past the first k: those rows sorted whole
        if bool(short.any()):
            whole, whole_ids = (scaled[short] - lse[short]).exp().sort(dim=-1, descending=True)
            top = torch.cat([top, top.new_zeros(top.shape[0], vocab - k)], dim=-1)
            ids = torch.cat([ids, ids.new_zeros(ids.shape[0], vocab - k)], dim=-1)
            top[short], ids[short] = whole, whole_ids
    if top_p < 1:
        before = top.cumsum(-1) - top  # the probability of the likelier tokens
        top = top * (before < top_p)
    cdf = top.cumsum(-1)
    at = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1).contiguous(), right=True)
    return ids.gather(-1, at.clamp(max=ids.shape[-1] - 1)).squeeze(-1)


class RowStreams:
    """One random stream per row, seeded by the row's seed: the uniform a row's next token is drawn
    at depends on its seed and how many tokens it has drawn, never on the batch it is drawn in.
    Shared by every decoder of the trainers (this one, :mod:`.mlx_decoding`), so one seed gives one
    answer on either backend, up to the logits' rounding."""

    def __init__(self, seeds: Sequence[int]) -> None:
        self._streams = [torch.Generator().manual_seed(int(s) & 0xFFFF_FFFF_FFFF_FFFF) for s in seeds]

    def uniforms(self, rows: Sequence[int]) -> torch.Tensor:
        """``[len(rows)]`` CPU fp32: the next uniform of each of ``rows``' streams, in that order."""
        return torch.cat([torch.rand(1, generator=self._streams[r]) for r in rows])


def check_rows(rows: Sequence[Sequence[int]], seeds: Sequence[int]) -> None:
    """What every decoder of the trainers refuses: a seed count that is not the rows', an empty prompt."""
    if len(seeds) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(seeds)} seeds")
    if any(not r for r in rows):
        raise ValueError("an empty prompt")


@torch.no_grad()
def draw(body: Any, head_weight: torch.Tensor, rows: Sequence[Sequence[int]], max_new_tokens: int,
         temperature: float, top_p: float, seeds: Sequence[int], end_ids: Sequence[int], pad_id: int
         ) -> list[list[int]]:
    """Each of ``rows`` (prompt token ids) continued by up to ``max_new_tokens`` tokens drawn from the
    model whose body (the decoder stack, returning ``last_hidden_state``) is ``body`` and whose
    output head multiplies by ``head_weight``; row ``i`` draws from a stream seeded ``seeds[i]``.
    The new ids of each row, without the end token that ended it."""
    check_rows(rows, seeds)
    if not rows:
        return []
    from transformers import DynamicCache

    from rlfleet.shared.models import cache_argument
    from rlfleet.shared.responder import left_padded

    device = head_weight.device
    ids, mask = left_padded(rows, pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # positions count a row's real tokens only
    cache = DynamicCache(config=body.config)
    kv = {cache_argument(body): cache}
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                  **kv).last_hidden_state[:, -1]
    streams = RowStreams(seeds)
    ends = torch.tensor(sorted({int(e) for e in end_ids}) or [-1], device=device)
    out: list[list[int]] = [[] for _ in rows]
    live = list(range(len(rows)))  # the rows still drawing, in the batch's order
    at = positions[:, -1]
    for step in range(max_new_tokens):
        logits = F.linear(hidden.to(head_weight.dtype), head_weight).float()
        tokens = pick(logits, temperature, top_p, streams.uniforms(live).to(device))
        ended = torch.isin(tokens, ends)
        for r, t, e in zip(live, tokens.tolist(), ended.tolist(), strict=True):
            if not e:
                out[r].append(t)
        if step + 1 == max_new_tokens:
            break
        keep = (~ended).nonzero().squeeze(-1)
        if keep.numel() == 0:
            break
        if keep.numel() < len(live):  # ended rows leave the batch, their keys and values with them
            cache.batch_select_indices(keep)
            live = [live[i] for i in keep.tolist()]
            tokens, mask, at = tokens[keep], mask[keep], at[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        at = at + 1
        hidden = body(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=at.unsqueeze(-1),
                      use_cache=True, **kv).last_hidden_state[:, -1]
    return out

