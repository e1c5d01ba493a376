"""The answers a training run samples (exploration, the gate, the loop checks), drawn three ways on one
model and the same prompts: llama.cpp's batch (``chat.engine`` auto on a CPU with a GGUF model), the
trainer's own batched decoding (worker/training/decoding.py: torch draws, per-row seeds, rows leaving
the batch as they end, bf16 where native) and transformers' ``generate`` as the trainer called it
before (fp32, every row to the longest, one random stream per batch).

Each way draws ``--rows`` answers of at most ``--new-tokens`` tokens (four per prompt, as a run
explores, at the chat's temperature 0.7 and top-p 0.9), from the base, inside a training session with
a LoRA (what exploration and the loop checks draw from), ``--rounds`` times alternated; medians.
Tokens/s counts the answers' tokens, so a way that stops a row at its end is not charged for padding.

    python -m bench.draw [--model smollm2-135m] [--rows 64] [--new-tokens 64] [--rounds 3] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from .record import markdown_table, output_options, parser, publish

TOPICS = ["rain", "tea", "maps", "jazz", "bread", "snow", "chess", "kites", "ships", "owls", "silk", "bees",
          "sand", "wine", "fog", "oak"]
WAYS = ("llama.cpp", "decoding", "generate")


def draw_options(ap: argparse.ArgumentParser) -> None:
    """The options of a benchmark that draws a run's answers (this one, bench.draw_mlx)."""
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--rows", type=int, default=64, help="answers per draw (default 64, a run's exploration)")
    ap.add_argument("--new-tokens", type=int, default=64, help="length cap of an answer (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds; medians reported (default 3)")


def parse_draw_options(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed with the output options added, refused where nothing would be drawn."""
    output_options(ap)
    args = ap.parse_args(argv)
    if args.rows < 1 or args.new_tokens < 1 or args.rounds < 1:
        ap.error("--rows, --new-tokens and --rounds take a positive number")
    return args


def draw_prompts(rows: int) -> list[list[dict]]:
    """``rows`` one-message chats, four per topic, as a run explores."""
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i // 4 % len(TOPICS)]} in two sentences."}]
            for i in range(rows)]


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.draw", __doc__)
    draw_options(ap)
    ap.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    args = parse_draw_options(ap, argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.presets import preset
    from rlfleet.worker.training import torch_backend
    from rlfleet.worker.training.torch_backend import Trainer

    trainer = Trainer(resolve_model(args.model))
    prompts = draw_prompts(args.rows)
    decoder = torch_backend._decoder

    def run(way: str) -> tuple[float, int]:
        trainer.draw_with("auto" if way == "llama.cpp" else "torch", load=True)
        torch_backend._decoder = decoder if way != "generate" else (lambda model: None)
        try:
            trainer.sample(prompts[:2], 2, 0)  # warm-up: llama.cpp's context, the bf16 copies' first use
            t0 = time.perf_counter()
            out = trainer.sample(prompts, args.new_tokens, 0, 0.7, 0.9)
            return time.perf_counter() - t0, sum(len(a) for a in out)
        finally:
            torch_backend._decoder = decoder

    trainer.draw_with("auto")
    ways = [w for w in WAYS if w != "llama.cpp" or trainer.drawer.engine == "llama.cpp"]
    cfg = preset("balanced")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for where in ("base", "session"):
            for way in ways:
                if where == "base":
                    seconds, n = run(way)
                else:
                    with trainer.adapter(None, cfg, trainable=True, precision="auto"):
                        seconds, n = run(way)
                times.setdefault((where, way), []).append(n / seconds)
    rows, figures = [], {"model": args.model, "rows": args.rows, "new_tokens": args.new_tokens,
                         "draw_precision": "bf16" if trainer._draw_bf16 else "fp32", "ways": {}}
    for where in ("base", "session"):
        llama = statistics.median(times[(where, "llama.cpp")]) if "llama.cpp" in ways else None
        gen = statistics.median(times[(where, "generate")])
        for way in ways:
            tps = statistics.median(times[(where, way)])
            figures["ways"][f"{where}/{way}"] = tps
            rows.append([where, way, f"{tps:.0f}", f"{tps / gen:.2f}×",
                         f"{tps / llama:.2f}×" if llama else "–"])
    text = markdown_table(["weights", "way", "answer tokens/s", "vs generate", "vs llama.cpp"], rows)
    text += (f"\n\n{args.rows} answers of at most {args.new_tokens} tokens, temperature 0.7, top-p 0.9; "
             f"decoding in {figures['draw_precision']}; {torch.get_num_threads()} thread(s); "
             f"medians of {args.rounds} round(s), the ways alternated.")
    publish(figures, text, args, f"`bench.draw` · {args.model} · {args.rows} answers · {args.new_tokens} tokens")
    return figures


if __name__ == "__main__":
    main()
