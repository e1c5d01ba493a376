"""The answers a training run samples, drawn on the MLX backend (``train.device = "mlx"``, Apple
Silicon; mlx also runs on a Linux CPU) three ways on one model and the same prompts: the MLX trainer's
batched decoding (worker/training/mlx_decoding.py: one batch, per-row seeds, rows leaving the batch as
they end), mlx_lm's own ``batch_generate`` (the peer a user would pick to draw a batch with mlx_lm),
and mlx_lm's ``generate_step`` one prompt at a time (what the trainer did before, and what
``mlx_lm.generate`` does).

Each way draws ``--rows`` answers of at most ``--new-tokens`` tokens (four per prompt, as a run
explores, at the chat's temperature 0.7 and top-p 0.9) from the base, ``--rounds`` times alternated;
medians. Tokens/s counts the answers' tokens.

    python -m bench.draw_mlx [--model smollm2-135m] [--rows 64] [--new-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from .draw import draw_options, draw_prompts, parse_draw_options
from .record import markdown_table, parser, publish

WAYS = ("rlfleet", "batch_generate", "one at a time")


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.draw_mlx", __doc__)
    draw_options(ap)
    args = parse_draw_options(ap, argv)

    from rlfleet.shared.errors import ModelUnavailable
    from rlfleet.worker.training.mlx_model import require_mlx

    try:
        require_mlx()
    except ModelUnavailable as exc:
        ap.error(str(exc))
    import mlx.core as mx

    from rlfleet.shared.chat_prompt import prompt_ids
    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.training.mlx_backend import MlxTrainer

    trainer = MlxTrainer(resolve_model(args.model))
    prompts = draw_prompts(args.rows)
    rows = [prompt_ids(trainer.tokenizer, p) for p in prompts]
    ends = list(trainer._end_ids)
    ways: dict[str, Callable[[Sequence[list[int]], int], list[list[int]]]] = {
        "rlfleet": lambda rows, n: trainer.sample(prompts[:len(rows)], n, 0, 0.7, 0.9),
        "batch_generate": lambda rows, n: _batch_generate(trainer.model, rows, n, ends),
        "one at a time": lambda rows, n: [_one(trainer.model, r, n, ends) for r in rows],
    }
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for way, fn in ways.items():
            fn(rows[:2], 2)  # warm-up
            mx.random.seed(0)
            t0 = time.perf_counter()
            out = fn(rows, args.new_tokens)
            seconds = time.perf_counter() - t0
            times.setdefault(way, []).append(sum(len(a) for a in out) / seconds)
    peer = statistics.median(times["batch_generate"])
    figures: dict[str, Any] = {"model": args.model, "rows": args.rows, "new_tokens": args.new_tokens,
                               "device": str(mx.default_device()), "ways": {}}
    table = []
    for way in ways:
        tps = statistics.median(times[way])
        figures["ways"][way] = tps
        table.append([way, f"{tps:.3g}", f"{tps / peer:.2f}×"])
    text = markdown_table(["way", "answer tokens/s", "vs batch_generate"], table)
    text += (f"\n\n{args.rows} answers of at most {args.new_tokens} tokens, temperature 0.7, top-p 0.9; "
             f"mlx on {figures['device']}, fp32 weights (the trainer's); medians of {args.rounds} round(s), "
             "the ways alternated.")
    publish(figures, text, args, f"`bench.draw_mlx` · {args.model} · {args.rows} answers · {args.new_tokens} tokens")
    return figures


def _sampler() -> Any:
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(temp=0.7, top_p=0.9)


def _batch_generate(model: Any, rows: Sequence[list[int]], max_new_tokens: int, ends: list[int]) -> list[list[int]]:
    from mlx_lm.generate import batch_generate

    class Tokens:  # what batch_generate reads of a tokenizer: the end ids, and a decode it calls
        eos_token_ids = ends

        @staticmethod
        def decode(ids: list[int]) -> str:
            return ""

    out = batch_generate(model, Tokens(), list(rows), max_tokens=max_new_tokens, return_token_ids=True,
                         sampler=_sampler(), completion_batch_size=len(rows), prefill_batch_size=len(rows))
    return [list(a) for a in out.token_ids]


def _one(model: Any, row: list[int], max_new_tokens: int, ends: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    new: list[int] = []
    for token, _ in generate_step(mx.array(row, dtype=mx.int32), model, max_tokens=max_new_tokens,
                                  sampler=_sampler()):
        if int(token) in ends:
            break
        new.append(int(token))
    return new


if __name__ == "__main__":
    main()
