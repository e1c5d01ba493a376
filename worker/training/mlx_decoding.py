"""Answers drawn by the MLX trainer's model, batched, each row with its own random stream.

The MLX counterpart of :mod:`.decoding`, with its rules: the prompts are left-padded into one batch
whose keys and values sit in mlx_lm's batch cache (each row's positions count its own tokens), a row
leaves the batch as it ends, and each next token is :func:`.decoding.pick`'s, at the uniform of the
row's own stream (:class:`.decoding.RowStreams`). So an answer is the same in whichever batch it is
drawn, and the same seed draws the same answer as the torch trainer from the same weights, up to
the logits' rounding. A model whose cache does not batch (mlx_lm builds each layer's) draws its rows
one at a time, by the same rules.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from .decoding import RowStreams, check_rows, pick

log = logging.getLogger(__name__)
_said: set[str] = set()  # the reasons a model's rows were drawn one at a time, warned once each


def draw(model: Any, rows: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, top_p: float,
         seeds: Sequence[int], end_ids: Sequence[int], pad_id: int) -> list[list[int]]:
    """Each of ``rows`` (prompt token ids) continued by up to ``max_new_tokens`` tokens drawn from the
    mlx_lm ``model``; row ``i`` draws from a stream seeded ``seeds[i]``. The new ids of each row,
    without the end token that ended it."""
    check_rows(rows, seeds)
    if not rows:
        return []
    streams = RowStreams(seeds)
    try:
        cache, first = _prefill(model, rows, pad_id)
    except (AttributeError, NotImplementedError, TypeError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if reason not in _said:
            _said.add(reason)
            log.warning("this model's key/value cache does not batch in mlx_lm (%s); its answers are drawn "
                        "one at a time", reason)
        out: list[list[int]] = []
        for i, row in enumerate(rows):
            cache, first = _prefill(model, [row], pad_id, batched=False)
            out += _continue(model, cache, first, [i], streams, max_new_tokens, temperature, top_p, end_ids)
        return out
    return _continue(model, cache, first, list(range(len(rows))), streams, max_new_tokens, temperature, top_p,
                     end_ids)


def _prefill(model: Any, rows: Sequence[Sequence[int]], pad_id: int, batched: bool = True) -> tuple[list[Any], Any]:
    """The prompts' cache and the ``[B, V]`` logits of each row's first new token. Batched: left-padded
    rows in mlx_lm's batch cache (merged from the model's own, told each row's padding); else one row
    in the model's own cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    width = max(len(r) for r in rows)
    pads = [width - len(r) for r in rows]
    ids = mx.array([[pad_id] * p + list(r) for p, r in zip(pads, rows, strict=True)], dtype=mx.int32)
    cache = make_prompt_cache(model)
    if batched:
        cache = [type(c).merge([c] * len(rows)) for c in cache]
        for c in cache:
            c.prepare(left_padding=pads)
    return cache, model(ids, cache=cache)[:, -1]


def _continue(model: Any, cache: list[Any], logits: Any, rows: list[int], streams: RowStreams,
              max_new_tokens: int, temperature: float, top_p: float, end_ids: Sequence[int]) -> list[list[int]]:
    """Draw from ``logits`` (``[B, V]``, one row of the batch per entry of ``rows``, the index of its
    stream) on, each step feeding the drawn tokens through ``model`` and ``cache``; the rows' answers
    in ``rows``' order."""
    import mlx.core as mx
    import torch

    ends = {int(e) for e in end_ids}
    out: dict[int, list[int]] = {r: [] for r in rows}
    live = list(rows)
    for step in range(max_new_tokens):
        scores = torch.from_numpy(np.array(logits.astype(mx.float32)))
        tokens = pick(scores, temperature, top_p, streams.uniforms(live)).tolist()
        keep = [k for k, t in enumerate(tokens) if t not in ends]
        for k in keep:
            out[live[k]].append(tokens[k])
        if step + 1 == max_new_tokens or not keep:
            break
        if len(keep) < len(live):  # ended rows leave the batch, their keys and values with them
            for c in cache:
                c.filter(mx.array(keep))
            live, tokens = [live[k] for k in keep], [tokens[k] for k in keep]
        logits = model(mx.array(tokens, dtype=mx.int32)[:, None], cache=cache)[:, -1]
    return [out[r] for r in rows]
