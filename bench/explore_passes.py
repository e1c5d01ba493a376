"""A run's passes before its first update, over exploration's answers: one row per answer and per
earlier ending (and a reference pass of their own) against one pass per answer that also reads its
endings and keeps their log-probs, side by side in one process.

What an exploring run computes before it trains, on the default model: the reward model's features
of ``--prompts`` prompts × ``--answers`` sampled answers (64 tokens at most, as ``train.explore``
samples them) and of each answer's earlier endings (``train.explore_cuts``), then the reference
log-probs, in the training micro-batches, of the answers and of one ending each (at most one joins
its answer's group; a first run: the reference is the starting policy, its behaviour pass too).

* ``rows``: every ending encoded as a row of its own, and the reference pass run over every row;
* ``shared``: ``reward_features.features_with_endings`` (each ending one extra position in its
  answer's pass) and the reference pass answered from the log-probs those passes kept.

Rounds alternate the two; the figures are medians. Also printed: the largest difference between the
two ways' features and log-probs (what a run sees must not change).

    python -m bench.explore_passes [--prompts 16] [--answers 4] [--rounds 3] [--threads N] [--json] [--no-record]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from .record import markdown_table, output_options, parser, publish


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.explore_passes", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--prompts", type=int, default=16, help="explored prompts (default 16, train.explore_prompts)")
    ap.add_argument("--answers", type=int, default=4, help="answers per prompt (default 4, train.explore)")
    ap.add_argument("--cuts", type=int, default=2, help="earlier endings tried per answer (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each way, alternated (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--seed", type=int, default=0, help="the answers' sampling seed (default 0)")
    output_options(ap)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    from rlfleet.shared.models import resolve_model
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.presets import CPU_MICRO_BATCH_TOKENS, preset
    from rlfleet.worker.samples import TrainSample
    from rlfleet.worker.training import exploration, feature_memo
    from rlfleet.worker.training.reward_features import features, features_with_endings
    from rlfleet.worker.training.torch_backend import Trainer

    from .learning.simulate import heldout_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    backend = Trainer(resolve_model(args.model))
    tok = backend.tokenizer
    cfg = replace(preset("balanced"), precision="fp32")
    budget = CPU_MICRO_BATCH_TOKENS
    prompts = [[{"role": "user", "content": p}] for p in heldout_prompts(args.prompts)]
    rows = [p for p in prompts for _ in range(args.answers)]
    ids = backend.sample(rows, 64, seed=args.seed)
    answers = [TrainSample(None, p, tok.decode(a, skip_special_tokens=True), 0.0, complete=len(a) < 64)
               for p, a in zip(rows, ids, strict=True)]
    heads = exploration.ending_candidates(answers, args.cuts)
    every = answers + [c for h in heads for c in h]
    # What the run trains on: the answers and, where the reward model prefers one, one ending each
    # (here each answer's first: at most one joins, whichever it is).
    trained = answers + [h[0] for h in heads if h]
    encoded = [encode_sample(tok, s, cfg.max_tokens) for s in trained]

    def reference() -> list:
        _groups, batches = backend.batches(encoded, budget)
        with backend.reference():
            return [(b, backend.logprobs(b)) for b in batches]

    def by_rows() -> tuple[np.ndarray, list]:
        own = features(backend, answers, cfg.max_tokens)
        cuts = [c for h in heads for c in h]
        parts = [own, features(backend, cuts, cfg.max_tokens)] if cuts else [own]
        feature_memo.forget(backend)  # this way has nothing kept: its reference pass runs over every row
        return np.vstack(parts), reference()

    def shared() -> tuple[np.ndarray, list]:
        own, cut = features_with_endings(backend, answers, heads, cfg.max_tokens)
        return np.vstack([own, *[c for c in cut if len(c)]]), reference()

    ways = {"rows": by_rows, "shared": shared}
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    results: dict[str, tuple[np.ndarray, list]] = {}
    for _ in range(args.rounds):
        for name, way in ways.items():
            feature_memo.forget(backend)  # nothing an earlier round or way kept
            with backend.adapter(None, cfg, trainable=True):  # a first run's session: a fresh LoRA
                t0 = time.perf_counter()
                results[name] = way()
                seconds[name].append(time.perf_counter() - t0)
    feature_gap = float(np.abs(results["rows"][0] - results["shared"][0]).max())
    lp_gap = max(float((a[b["response_mask"]] - c[b["response_mask"]]).abs().max())
                 for (b, a), (_, c) in zip(results["rows"][1], results["shared"][1], strict=True))
    med = {w: statistics.median(s) for w, s in seconds.items()}
    n_cuts = sum(len(h) for h in heads)
    figures = {"model": args.model, "answers": len(answers), "endings": n_cuts, "rounds": args.rounds,
               "rows_seconds": med["rows"], "shared_seconds": med["shared"],
               "speedup": med["rows"] / med["shared"], "max_feature_difference": feature_gap,
               "max_logprob_difference": lp_gap, "threads": torch.get_num_threads()}
    text = markdown_table(
        ["way", "features + reference pass (s, median)", "rows encoded"],
        [["rows: every ending a row, a reference pass of its own", f"{med['rows']:.1f}", len(every) + len(trained)],
         ["shared: endings in their answer's pass, log-probs kept", f"{med['shared']:.1f}", len(answers)]])
    text += (f"\n\n{len(answers)} answers ({args.prompts} prompts × {args.answers}), {n_cuts} earlier endings; "
             f"rows / shared: **{figures['speedup']:.2f}×**. Largest difference between the two ways: "
             f"features {feature_gap:.2e}, log-probs {lp_gap:.2e} nats. {args.rounds} round(s) of each, "
             f"alternated; {figures['threads']} thread(s).")
    publish(figures, text, args, f"`bench.explore_passes` · {args.model} · {len(answers)} answers · "
            f"{n_cuts} endings")
    return figures


if __name__ == "__main__":
    main()
