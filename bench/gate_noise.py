"""How noisy the evaluation gate's repetition reading is, as a function of how many answers it samples.

The gate (worker/gate.py) samples `eval_samples` answers from the base and from the candidate on the
held-out prompts, at the chat's temperature and top-p, and refuses a candidate whose mean share of
repeated trigrams inside an answer exceeds the base's by more than `max_repetition_rise` (0.03). Here
the SAME model, the base, is read several times with different seeds, exactly as the gate reads it
(the gate's own `scoring.sample_answers`, then `gate.repetition`): any gap between two
readings is noise, and where gaps above the bound are common the check refuses good candidates (and
passes bad ones) by chance.

Prompts: the learning benchmark's held-out prompts (`--prompts`, 16 by default; the answers cycle
through them as the gate's do through a run's held-out ratings, of which a run of 32 ratings has 5).
Reading d of size n uses seed `--seed + 1000*n + d`.

Figures per size: the readings' mean, min, max and standard deviation, the largest gap between two
readings, and the share of pairs of readings further apart than the gate's bound. The ratio of the
spreads (standard deviation at the smallest size over that at the largest) is the figure to compare
across machines; about sqrt(largest/smallest) is what independent answers predict.

    python -m bench.gate_noise [--model smollm2-135m] [--sizes 8,32] [--draws 8] [--device auto] [--json] [--no-record]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from typing import Any

from .record import output_options, parser, publish

PROMPTS_DEFAULT = 16


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of whole numbers (e.g. 8,32)") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be at least 1 answer (e.g. 8,32)")
    return sorted(set(sizes))


def parse(argv: list[str] | None) -> argparse.Namespace:
    from rlfleet.worker.gate import GateConfig

    from .learning.simulate import HELD_OUT_TOPICS

    gate = GateConfig()
    ap = parser("bench.gate_noise", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--sizes", type=_sizes, default=[8, 32],
                    help="answers per reading, a comma list (default 8,32; the gate samples "
                         f"{gate.eval_samples})")
    ap.add_argument("--draws", type=int, default=8, help="readings per size, each with its own seed (default 8)")
    ap.add_argument("--prompts", type=int, default=PROMPTS_DEFAULT,
                    help=f"distinct held-out prompts the answers cycle through (default {PROMPTS_DEFAULT}, "
                         f"at most {len(HELD_OUT_TOPICS)})")
    ap.add_argument("--new-tokens", type=int, default=gate.eval_new_tokens,
                    help=f"tokens per answer at most (default {gate.eval_new_tokens}, the gate's)")
    ap.add_argument("--temperature", type=float, default=gate.eval_temperature,
                    help=f"default {gate.eval_temperature}, the gate's")
    ap.add_argument("--top-p", type=float, default=gate.eval_top_p, help=f"default {gate.eval_top_p}, the gate's")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    ap.add_argument("--seed", type=int, default=0, help="base seed (default 0)")
    output_options(ap)
    args = ap.parse_args(argv)
    if not 2 <= args.draws <= 1000:
        ap.error("--draws must be between 2 and 1000 (a spread needs two readings; seeds repeat past 1000)")
    if not 1 <= args.prompts <= len(HELD_OUT_TOPICS):
        ap.error(f"--prompts must be between 1 and {len(HELD_OUT_TOPICS)}")
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")
    if args.temperature <= 0:
        ap.error("--temperature must be above 0 (at 0 every seed gives the same answers)")
    if not 0 < args.top_p <= 1:
        ap.error("--top-p must be in (0, 1]")
    args.bound = gate.max_repetition_rise
    return args


def chat_prompts(n: int) -> list[list[dict]]:
    """The learning benchmark's first ``n`` held-out prompts, as one-message chats."""
    from .learning.simulate import heldout_prompts

    return [[{"role": "user", "content": text}] for text in heldout_prompts(n)]


def read(trainer: Any, prompts: list[list[dict]], n: int, seed: int, args: argparse.Namespace) -> list[list[int]]:
    """One reading's answers: ``n`` of them, drawn by the gate's own sampling
    (:func:`rlfleet.worker.training.scoring.sample_answers`) at this run's settings."""
    from dataclasses import replace

    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.training.scoring import sample_answers

    cfg = replace(GateConfig(), eval_samples=n, eval_new_tokens=args.new_tokens, eval_temperature=args.temperature,
                  eval_top_p=args.top_p)
    return sample_answers(trainer, prompts, cfg, seed)


def summarise(n: int, readings: list[float], lengths: list[float], bound: float) -> dict:
    gaps = [abs(a - b) for a, b in itertools.combinations(readings, 2)]
    return {
        "answers": n,
        "draws": len(readings),
        "readings": readings,
        "mean": statistics.fmean(readings),
        "min": min(readings),
        "max": max(readings),
        "std": statistics.stdev(readings),
        "largest_gap": max(gaps),
        "pairs_over_bound": sum(g > bound for g in gaps) / len(gaps),
        "answer_tokens": statistics.fmean(lengths),  # mean sampled length (repetition grows with it)
    }


def table(rows: list[dict], bound: float) -> str:
    from .record import markdown_table

    header = ["answers", "draws", "mean", "min", "max", "std", "largest gap", f"pairs > {bound:g}",
              "answer tokens"]
    body = [[r["answers"], r["draws"], f"{r['mean']:.3f}", f"{r['min']:.3f}", f"{r['max']:.3f}", f"{r['std']:.3f}",
             f"{r['largest_gap']:.3f}", f"{r['pairs_over_bound']:.0%}", f"{r['answer_tokens']:.1f}"] for r in rows]
    return markdown_table(header, body)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from rich.console import Console
    from rich.progress import Progress as Bar

    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.worker.gate import repetition
    from rlfleet.worker.training.torch_backend import Trainer

    device = pick_device(args.device)
    console = Console(stderr=True)  # stdout carries the table or the JSON only
    with console.status(f"loading {args.model} on {device}"):
        trainer = Trainer(resolve_model(args.model), device)
    prompts = chat_prompts(args.prompts)
    rows = []
    with Bar(console=console, transient=True) as bar:
        task = bar.add_task("gate_noise", total=len(args.sizes) * args.draws)
        for n in args.sizes:
            readings, lengths = [], []
            for d in range(args.draws):
                bar.update(task, description=f"{n} answers · reading {d + 1}/{args.draws}")
                tokens = read(trainer, prompts, n, args.seed + 1000 * n + d, args)
                readings.append(repetition(tokens))
                lengths.append(sum(len(t) for t in tokens) / len(tokens))
                bar.advance(task)
            rows.append(summarise(n, readings, lengths, args.bound))

    small, large = rows[0], rows[-1]
    ratio = small["std"] / large["std"] if large["std"] > 0 else None
    figures = {
        "model": args.model, "device": device, "prompts": args.prompts, "new_tokens": args.new_tokens,
        "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed, "bound": args.bound,
        "rows": rows, "std_ratio": ratio,
    }
    if len(rows) == 1:
        spread = "one size only: no ratio of spreads."
    elif ratio is None:
        spread = f"std at {large['answers']} answers is 0: no ratio of spreads."
    else:
        spread = (f"spread ratio (std at {small['answers']} answers / std at {large['answers']}): {ratio:.2f} "
                  f"(independent answers: about {(large['answers'] / small['answers']) ** 0.5:.2f}).")
    text = (
        table(rows, args.bound)
        + f"\n\nRepetition (mean share of repeated trigrams per answer) of the same model read {args.draws} times "
        f"per size with different seeds; the gate refuses a rise over {args.bound:g}. {spread} "
        f"{args.prompts} prompts, {args.new_tokens} new tokens, temperature {args.temperature:g}, "
        f"top-p {args.top_p:g}."
    )
    publish(figures, text, args, f"`bench.gate_noise` · {args.model} · {device} · "
            f"sizes {','.join(map(str, args.sizes))} · {args.draws} draws")
    return figures


if __name__ == "__main__":
    main()
