"""How often a run's reward model can be trusted on a few ratings, with and without each answer
statistic: the base model's held-out answers (the learning benchmark's prompts, seeds and length cap),
labelled by a named preference, subsampled to a run's mix of liked and disliked answers, and
cross-validated on the statistics alone as the worker does (worker/training/reward_model.py).

    python -m bench.reward_features --preference short:34 --liked 2 --disliked 24 --draws 40

Prints, per statistics set (all of them, and each one left out), the mean cross-validated AUC over the
draws and how often it reaches the exploration bar (``train.reward_model_min_auc``, 0.75).
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import numpy as np

from rlfleet.shared.models import load_tokenizer, resolve_model
from rlfleet.shared.responder import LocalResponder
from rlfleet.worker.training import reward_features as rf
from rlfleet.worker.training.reward_model import MAX_FOLDS, cross_validated_auc

from .learning.raters import preference
from .learning.simulate import heldout_prompts

NAMES = ("log tokens", "log(1 + words)", "sentence ends")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.reward_features", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preference", default="short:34", help="a named preference (default short:34)")
    ap.add_argument("--model", default="smollm2-135m", help="alias, local folder or hub id")
    ap.add_argument("--heldout", type=int, default=16, help="held-out prompts (default 16)")
    ap.add_argument("--samples", type=int, default=4, help="answers per prompt (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--liked", type=int, default=2, help="liked answers per draw (default 2)")
    ap.add_argument("--disliked", type=int, default=24, help="disliked answers per draw (default 24)")
    ap.add_argument("--draws", type=int, default=40)
    ap.add_argument("--bar", type=float, default=0.75, help="the AUC exploration needs (default 0.75)")
    return ap.parse_args(argv)


def base_answers(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """``(prompt, answer, answer tokens)`` of the base model, as bench.learning's first checkpoint samples them."""
    ref = resolve_model(args.model)
    responder = LocalResponder(ref, Path(tempfile.mkdtemp(prefix="rlfleet-rf-")), device="cpu",
                               max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.9)
    tok = load_tokenizer(ref)
    rows = [p for p in heldout_prompts(args.heldout) for _ in range(args.samples)]
    out = []
    for b, start in enumerate(range(0, len(rows), 32)):
        chunk = rows[start:start + 32]
        for p, a in zip(chunk, responder.sample([[{"role": "user", "content": p}] for p in chunk],
                                                 seed=10_000 + b), strict=True):
            out.append((p, a.text, len(tok(a.text)["input_ids"]) + 1))  # + the end token, as training counts
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    pref = preference(args.preference)
    answers = base_answers(args)
    labels = np.array([1.0 if pref.rate(p, a) == 1 else 0.0 for p, a, _ in answers])
    stats = np.array([rf.answer_statistics(a, n) for _, a, n in answers])
    pos, neg = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
    print(f"{args.preference}: {len(pos)} of {len(labels)} base answers liked; "
          f"{args.draws} draws of {args.liked} liked and {args.disliked} disliked")
    if len(pos) < args.liked or len(neg) < args.disliked:
        raise SystemExit("too few answers of one class for that draw: lower --liked/--disliked")
    sets = {"all statistics": list(range(len(NAMES)))}
    sets |= {f"without {n}": [j for j in range(len(NAMES)) if j != i] for i, n in enumerate(NAMES)}
    print(f"{'statistics':<28} {'mean AUC':>9} {'share >= bar':>13}")
    for name, cols in sets.items():
        aucs = []
        for d in range(args.draws):
            rng = random.Random(d)
            idx = rng.sample(list(pos), args.liked) + rng.sample(list(neg), args.disliked)
            aucs.append(cross_validated_auc(stats[idx][:, cols], labels[idx], MAX_FOLDS, seed=d).auc)
        print(f"{name:<28} {np.mean(aucs):>9.3f} {np.mean([a >= args.bar for a in aucs]):>13.0%}")


if __name__ == "__main__":
    main()
