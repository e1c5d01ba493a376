"""python -m bench.learning --preference NAME --ratings 64 [--objective mispo|soft|reinforce|kto] [--then NAME] [--json]

Does rating improve the model? A scripted user with a hidden preference rates answers through
the real pipeline, with a comment on a thumbs-down as a person types it (`/rl bad too long, keep it
under 30 words`; `--no-comments`: the thumbs alone); held-out prompts (16 x 4 answers by default,
sampled in batches) measure the preferred-behaviour rate (95 % Wilson interval), the log-prob margin
of held-out good over bad answers, and collapse signals (distinct bigrams, repeated trigrams as the
gate counts them), after 0 ratings and after every `--threshold` ratings. `--compare` runs every
objective at equal ratings and compute and writes a markdown table and a PNG plot.

Forgetting: `--then SPEC` changes the user's mind after half of `--ratings` (or `--switch-at N`), from
then on they rate by SPEC. The rates (`rate`, `base_rate`, `final_rate`, `delta`) are then SPEC's, and
every checkpoint also scores the first preference on the same answers (`first_rate`, `first_ci95`);
`--json` adds `first_base_rate`, `first_switch_rate` (what was learned by the switch), `first_final_rate`
and `first_kept` (final minus switch: near 0 within the interval when nothing was forgotten). Each
checkpoint says how many earlier ratings the runs since the previous one replayed (`replayed`;
`--replay F` sets the runs' `train.replay`, 0 switches replay off).

Exploration: `--explore K` sets the runs' `train.explore` (answers sampled per rated prompt and scored
by the reward model when its AUC clears `train.reward_model_min_auc`); each run in `runs` says how many
it added (`explored`) and why (`explore_reason`).

`--json` carries, beside the rates and checkpoints: `base_distinct2`/`final_distinct2`,
`base_repeat`/`final_repeat` (mean share of repeated trigrams within an answer, the gate's measure),
`promoted` (versions the gate promoted), `reward_model_auc` (the last run's cross-validated AUC of
the reward model fitted on the ratings; null when it had too few of one class) and `teacher_gap`
(null: nothing learns from the comments yet).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from .raters import load_rater, named, preference
from .report import markdown_table, plot, slug
from .simulate import HELD_OUT_TOPICS, BenchConfig, run_benchmark

OBJECTIVES = ("mispo", "soft", "reinforce", "kto")


def parse(argv: list[str] | None) -> argparse.Namespace:
    prefs = "; ".join(f"{k}: {v}" for k, v in named().items())
    what = "\n\n".join(p.replace("\n", " ") for p in __doc__.split("\n\n")[1:3])  # what it measures, forgetting
    ap = argparse.ArgumentParser(
        prog="python -m bench.learning", description=what,
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=f"preferences: {prefs}",
    )
    who = ap.add_mutually_exclusive_group(required=True)
    who.add_argument("--preference", help="a named preference, NAME or NAME:ARG (e.g. short:25, topic:ocean)")
    who.add_argument("--rater", help="FILE.py:FUNC, a function (prompt, answer) -> 1 | -1 | None "
                     "or a pair (value, comment)")
    ap.add_argument("--ratings", type=int, default=64, help="ratings the simulated user gives (default 64)")
    ap.add_argument("--then", metavar="SPEC", help="a second preference (NAME[:ARG] or FILE.py:FUNC) the user "
                    "rates by after --switch-at ratings; the first one's rate is still scored at every checkpoint")
    ap.add_argument("--switch-at", type=int, metavar="N", help="ratings given by the first preference before "
                    "--then's takes over (default: half of --ratings)")
    ap.add_argument("--replay", type=float, metavar="F", help="train.replay for the runs: earlier ratings "
                    "replayed per new training rating (default: the config's, 0: off)")
    ap.add_argument("--explore", type=int, metavar="K", help="train.explore for the runs: answers sampled per "
                    "rated prompt and scored by the user's reward model (default: the config's; 0: off)")
    ap.add_argument("--explore-cuts", type=int, metavar="N", help="train.explore_cuts for the runs: each explored "
                    "answer's first N sentence ends tried as earlier endings (default: the config's; 0: off)")
    ap.add_argument("--explore-minibatches", type=int, metavar="N", help="train.explore_minibatches for the "
                    "runs: the explored answers split into N minibatches, one per optimizer step in turn "
                    "(default: the config's; 1: all in every step)")
    ap.add_argument("--objective", choices=OBJECTIVES, default="mispo")
    ap.add_argument("--compare", action="store_true", help="run every objective; print a table, write a plot")
    ap.add_argument("--model", default="smollm2-135m", help="alias, local folder or hub id")
    ap.add_argument("--threshold", type=int, default=32, help="ratings per training run (and per checkpoint)")
    ap.add_argument("--preset", default="balanced", choices=["careful", "balanced", "aggressive"])
    ap.add_argument("--lr", type=float, help="override the preset's learning rate")
    ap.add_argument("--steps", type=int, help="override the preset's optimizer steps per run")
    ap.add_argument("--beta", type=float, help="override the preset's KL weight (train.beta: how hard a run is "
                    "held to the base model)")
    ap.add_argument("--kl-top-k", type=int, metavar="K", help="override train.kl_top_k: the KL anchor over the "
                    "base's K likeliest next tokens and the rest (0: the answer's own token only)")
    ap.add_argument("--unlikelihood", type=float, metavar="W", help="override train.unlikelihood: the weight of "
                    "the unlikelihood term on the trigrams the policy repeats while it trains (0: off)")
    ap.add_argument("--entropy-hinge", type=float, metavar="W", help="override train.entropy_hinge: the weight of "
                    "the term holding the policy's next-token entropy on the rated answers at or below the base's "
                    "(0: off)")
    ap.add_argument("--balance", type=float, metavar="CAP", help="override train.balance: weight the rarer of "
                    "liked and disliked answers up, by at most CAP, until both pull equally (0: off)")
    ap.add_argument("--neg-fade", type=float, metavar="TAU", help="override train.neg_fade: a 👎's push fades "
                    "once its answer is TAU nats per token less likely than under the base (0: off)")
    ap.add_argument("--hindsight", type=float, metavar="W", help="train.hindsight for the runs: the weight of the "
                    "hindsight term, the student pulled toward a teacher reading each rating's comment "
                    "(default: the config's; 0: off)")
    ap.add_argument("--teacher", metavar="MODEL", help="train.teacher for the runs: a stronger hindsight teacher "
                    "sharing the model's tokenizer, a local folder or hub id (default: the model itself)")
    ap.add_argument("--rewrite", action=argparse.BooleanOptionalAction, default=None,
                    help="train.rewrite for the runs: the teacher writes an answer under each 👎's words, "
                    "trained as liked where the reward model scores it above the original (default: the "
                    "config's, off)")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"],
                    help="override train.precision, the training forward passes' precision (default: the "
                    "config's, auto: bf16 where the CPU or GPU does it natively)")
    ap.add_argument("--advantage", choices=["ema", "asymmetric"],
                    help="override train.advantage, how a rating becomes an advantage (docs/objective.md)")
    ap.add_argument("--heldout", type=int, default=16,
                    help=f"held-out prompts (default 16, at most {len(HELD_OUT_TOPICS)})")
    ap.add_argument("--samples", type=int, default=4, help="answers per held-out prompt per checkpoint (default 4)")
    ap.add_argument("--batch", type=int, default=32, help="held-out answers per generate call (default 32)")
    ap.add_argument("--no-comments", action="store_true", help="rate without words (no comment on a thumbs-down)")
    ap.add_argument("--stars", action="store_true", help="rate in stars where the preference grades them "
                    "(short: by length; `/rl 2 too long`), else in thumbs")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    ap.add_argument("--engine", default="torch", choices=["torch", "auto", "llama.cpp"],
                    help="what draws the simulated chat's answers, the held-out ones and the training runs' "
                         "samples (chat.engine; default torch, as every figure before it; llama.cpp records its "
                         "own log-probs)")
    ap.add_argument("--no-gate", action="store_true", help="serve every run (no evaluation gate)")
    ap.add_argument("--no-fallback", action="store_true", help="train.fallback off: a version the gate refuses "
                    "is not replaced by the run's halfway step")
    ap.add_argument("--plot", type=Path, help="PNG to write (default with --compare: bench/learning/plots/)")
    ap.add_argument("--home", type=Path, help="data dir to run in and keep (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true", help="print one JSON object (a list with --compare)")
    args = ap.parse_args(argv)
    if min(args.ratings, args.threshold, args.heldout, args.samples, args.batch) < 1:
        ap.error("--ratings, --threshold, --heldout, --samples and --batch must be positive")
    if args.heldout > len(HELD_OUT_TOPICS):
        ap.error(f"--heldout: there are {len(HELD_OUT_TOPICS)} held-out prompts")
    if args.switch_at is not None and (args.then is None or not 0 < args.switch_at < args.ratings):
        ap.error("--switch-at needs --then and must be between 0 and --ratings")
    if args.explore_minibatches is not None and not 1 <= args.explore_minibatches <= 64:
        ap.error("--explore-minibatches must be between 1 and 64")
    bounded = (("--replay", args.replay, 4), ("--explore", args.explore, 64), ("--explore-cuts", args.explore_cuts, 8),
               ("--beta", args.beta, 10),
               ("--unlikelihood", args.unlikelihood, 100), ("--entropy-hinge", args.entropy_hinge, 100),
               ("--kl-top-k", args.kl_top_k, 1024), ("--balance", args.balance, 64),
               ("--neg-fade", args.neg_fade, 10), ("--hindsight", args.hindsight, 100))
    for flag, value, top in bounded:  # each the range its train.* setting accepts, from 0
        if value is not None and not 0 <= value <= top:
            ap.error(f"{flag} must be between 0 and {top}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    console = Console(stderr=True, log_path=False)
    try:
        pref = load_rater(args.rater) if args.rater else preference(args.preference)
        then = None if args.then is None else load_rater(args.then) if ".py:" in args.then else preference(args.then)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    overrides = {k: v for k, v in (("lr", args.lr), ("steps", args.steps), ("beta", args.beta),
                                   ("kl_top_k", args.kl_top_k), ("unlikelihood", args.unlikelihood),
                                   ("entropy_hinge", args.entropy_hinge),
                                   ("balance", args.balance), ("neg_fade", args.neg_fade),
                                   ("advantage", args.advantage), ("precision", args.precision),
                                   ("hindsight", args.hindsight), ("teacher", args.teacher),
                                   ("rewrite", args.rewrite),
                                   ("replay", args.replay), ("explore", args.explore),
                                   ("explore_cuts", args.explore_cuts),
                                   ("explore_minibatches", args.explore_minibatches),
                                   ("fallback", False if args.no_fallback else None)) if v is not None}
    objectives = OBJECTIVES if args.compare else (args.objective,)
    summaries = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        for objective in objectives:
            task = bar.add_task(objective, total=None)

            phase: list[str] = []

            def report(what: str, done: int, total: int, task=task, objective=objective, phase=phase) -> None:
                description = f"{objective}: {what}"
                if not console.is_terminal and phase[-1:] != [description]:
                    # A log file (grid runs, CI) gets no live bar: one timestamped line per phase instead.
                    phase.append(description)
                    console.log(description)
                bar.update(task, description=description, completed=done, total=total)

            scratch = None if args.home else tempfile.TemporaryDirectory(prefix="rlfleet-learning-")
            home = args.home / objective if args.home else Path(scratch.name)
            bc = BenchConfig(
                preference=pref, model=args.model, ratings=args.ratings, objective=objective,
                threshold=args.threshold, preset=args.preset, heldout=args.heldout, samples=args.samples,
                batch=args.batch, comments=not args.no_comments, stars=args.stars,
                max_new_tokens=args.max_new_tokens, seed=args.seed, device=args.device, engine=args.engine,
                gate=not args.no_gate,
                overrides=overrides, home=home, then=then, switch_at=args.switch_at,
            )
            try:
                result = run_benchmark(bc, report)
            finally:
                if scratch is not None:
                    scratch.cleanup()
            summaries.append(result.summary())
            bar.remove_task(task)
            if not args.json:
                _print_one(console, summaries[-1])

    target = args.plot or (Path(__file__).parent / "plots" / f"{slug(pref.name)}.png" if args.compare else None)
    if target is not None:
        written = plot(summaries, target)
        console.print(f"plot: {written}" if written else "[yellow]no plot: pip install matplotlib[/]")
    if args.json:
        print(json.dumps(_finite(summaries if args.compare else summaries[0]), default=str))
    elif args.compare:
        print(markdown_table(summaries))
    return 0


def _print_one(console: Console, s: dict) -> None:
    lo, hi = s["ci95"]
    measured = f"{s['then']} (after {s['preference']})" if s.get("then") else s["preference"]
    console.print(
        f"[bold]{s['objective']}[/] · {measured} · {s['ratings']} ratings: "
        f"rate {s['base_rate']:.2f} → {s['final_rate']:.2f} (Δ {s['delta']:+.2f}, 95% CI {lo:.2f}–{hi:.2f}) · "
        f"margin {s['margin_before']:+.3f} → {s['margin_after']:+.3f} · "
        f"words {s['answer_words_before']:.0f} → {s['answer_words_after']:.0f} · "
        f"distinct-2 {s['distinct2_before']:.2f} → {s['distinct2_after']:.2f} · "
        f"repeated trigrams {s['base_repeat']:.2f} → {s['final_repeat']:.2f} · "
        f"entropy ×{s['entropy_ratio']:.2f} · {s['seconds']:.0f} s"
    )
    if s.get("then"):
        lo, hi = s["first_final_ci95"] or (float("nan"), float("nan"))
        console.print(
            f"  {s['then']} from rating {s['switch_at'] + 1} on; {s['preference']}, the first preference: "
            f"{s['first_base_rate']:.2f} → {s['first_switch_rate']:.2f} at the switch → {s['first_final_rate']:.2f} "
            f"(95% CI {lo:.2f}–{hi:.2f}, kept {s['first_kept']:+.2f}); {s['replayed']} ratings replayed"
        )
    if s.get("controls_delta"):
        console.print("  the same answers by the other named preferences (a control), Δ: "
                      + ", ".join(f"{k} {v:+.2f}" for k, v in s["controls_delta"].items()))
    console.print(f"  {s['promoted']} of {len(s['runs'])} runs promoted by the gate")
    for r in s["runs"]:
        console.print(f"  run after {r['after_ratings']}: {r['version']} {r['state']}"
                      + (f" ({r['reason'] or r['error']})" if r["state"] != "succeeded" else ""))


def _finite(x):
    """NaN (e.g. no margin when the base never showed one of the behaviours) as JSON null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
