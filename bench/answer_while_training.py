"""How long a chat answer takes while a training run uses the same cores, by the training worker's
niceness (``train.nice``), beside the same answers with nothing else running.

Real parts: a fresh data dir, Redis, an events and a training worker as `rlfleet up` starts them, the
default model, and in this process the responder the chat answers with (``chat.engine`` auto: llama.cpp
where it runs). Each round, for each niceness in ``--nice`` (alternating): the answers with the workers
not yet started ("quiet"), then the threshold's ratings sent (the answers exist already, as in
bench.time_to_adapter), and once the run's progress says it is training (its optimizer steps: the
longest phase) the same answers again, back to back. An answer that ended after the run left its training
phase is counted apart (``after``). The workers are then stopped: the run's own time is
bench.time_to_adapter's.

    python -m bench.answer_while_training [--rounds 2] [--answers 4] [--nice 0,10] [--json]
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .record import markdown_table, output_options, parser, publish, stop_processes
from .time_to_adapter import _wait, seed_answers, start_workers

PROMPTS = ["How do I keep bread fresh for longer?", "What should I pack for a day of hiking?",
           "Why is the sky blue?", "Give me a tip for learning to play chess."]


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.answer_while_training", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each with every niceness (default 2)")
    ap.add_argument("--answers", type=int, default=4, help="answers timed per phase (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="answer cap (default 48)")
    ap.add_argument("--nice", default="0,10", help="the training worker's niceness values to compare (default 0,10)")
    ap.add_argument("--threshold", type=int, default=32, help="ratings that start the run (default 32)")
    ap.add_argument("--steps", type=int, default=None, help="the run's optimizer steps (default: the preset's)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for the run to train (default 600)")
    output_options(ap)
    args = ap.parse_args(argv)
    try:
        args.nice_values = [int(v) for v in args.nice.split(",") if v.strip()]
    except ValueError:
        ap.error(f"--nice: a comma-separated list of whole numbers, not {args.nice!r}")
    if not args.nice_values or any(not 0 <= v <= 19 for v in args.nice_values):
        ap.error("--nice: values from 0 to 19")
    if args.rounds < 1 or args.answers < 1 or args.threshold < 2:
        ap.error("--rounds and --answers must be at least 1, --threshold at least 2")
    from pydantic import ValidationError

    from rlfleet.shared.config import TrainSettings

    try:
        TrainSettings(steps=args.steps)
    except ValidationError as exc:
        ap.error(f"--steps: {exc.errors()[0]['msg']}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `finally`: the workers stop

    from rich.console import Console

    from rlfleet.shared.models import resolve_model
    from rlfleet.shared.responder import LocalResponder

    console = Console(stderr=True)
    ref = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="rlfleet-awt-", ignore_cleanup_errors=True) as tmp:
        responder = LocalResponder(ref, Path(tmp) / "no-adapters", max_new_tokens=args.max_new_tokens,
                                   engine="auto")
        rounds = []
        for r in range(args.rounds):
            for nice in args.nice_values:
                console.print(f"round {r + 1}, training worker at nice {nice}")
                rounds.append({"round": r + 1, "nice": nice,
                               **_round(args, Path(tempfile.mkdtemp(dir=tmp)), responder, nice, console)})
    figures: dict[str, Any] = {"model": args.model, "answers": args.answers, "max_new_tokens": args.max_new_tokens,
                               "threshold": args.threshold, "engine": responder.engine, "rounds": rounds,
                               "summary": summary(rounds)}
    publish(figures, report(figures), args, f"`bench.answer_while_training` · {args.model} · {args.answers} "
            f"answers a phase · nice {args.nice}")
    return figures


def _round(args, home: Path, responder, nice: int, console) -> dict:
    from rlfleet.shared.config import load_config
    from rlfleet.shared.events import Rating
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import enqueue_event, open_queue, progress_key
    from rlfleet.shared.store import Store

    quiet = _answers(responder, args.answers, lambda: "quiet")
    os.environ.update(RLFLEET_HOME=str(home), RLFLEET_MODEL=args.model)  # this process's config as the workers'
    os.environ.pop("REDIS_URL", None)  # the embedded server of this data dir, as a new user gets it
    env = dict(os.environ)
    cfg = load_config(home)
    cfg.train.threshold = args.threshold
    cfg.train.device = "cpu"
    cfg.train.nice = nice
    cfg.train.steps = args.steps
    cfg.save()
    handle = open_queue(cfg)
    store = Store(cfg.db_url)
    slug = model_slug(cfg.model)
    seed_answers(store, cfg.model, args.threshold)
    logs = open(home / "workers.log", "ab")
    procs = start_workers(env, logs)
    try:
        for i in range(args.threshold):
            enqueue_event(handle, Rating(target=f"c{i}", value=1 if i % 2 == 0 else -1))

        def phase() -> str:
            got = handle.redis.hget(progress_key(slug), "phase")
            return got.decode() if got else "waiting"

        def training() -> bool:
            dead = [p.args[-1] for p in procs if p.poll() is not None]
            if dead:
                tail = (home / "workers.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the {', '.join(dead)} worker stopped before the run trained:\n{tail}")
            return phase() == "training"

        _wait(training, args.timeout, "the run's training phase", poll=0.2)
        busy = _answers(responder, args.answers, phase)
    finally:
        stop_processes(procs)
        handle.close()
        store.close()
        logs.close()
    console.print(f"  quiet {statistics.median(a['seconds'] for a in quiet):.2f} s, while training "
                  f"{statistics.median(a['seconds'] for a in busy):.2f} s (median answer)")
    return {"quiet": quiet, "training": busy}


def _answers(responder, n: int, phase) -> list[dict]:
    """``n`` answers, each alone and timed, with the run's phase when it ended."""
    out = []
    for i in range(n):
        t = time.perf_counter()
        a = responder.answer([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], seed=i)
        out.append({"seconds": time.perf_counter() - t, "tokens": a.new_tokens, "phase": phase()})
    return out


def summary(rounds: list[dict]) -> dict:
    """Per niceness: the median answer's seconds quiet and while training (answers that ended in the
    training phase only), tokens/s over those answers, and the slowdown."""
    out: dict[str, dict] = {}
    for nice in sorted({r["nice"] for r in rounds}):
        mine = [r for r in rounds if r["nice"] == nice]
        quiet = [a for r in mine for a in r["quiet"]]
        busy = [a for r in mine for a in r["training"] if a["phase"] == "training"]
        row: dict[str, Any] = {"quiet_s": statistics.median(a["seconds"] for a in quiet),
                               "quiet_tps": _tps(quiet), "answers": len(busy),
                               "after": sum(len(r["training"]) for r in mine) - len(busy)}
        if busy:
            row.update(training_s=statistics.median(a["seconds"] for a in busy), training_tps=_tps(busy))
            row["slowdown"] = row["training_s"] / row["quiet_s"]
        out[str(nice)] = row
    return out


def _tps(answers: list[dict]) -> float:
    return sum(a["tokens"] for a in answers) / max(sum(a["seconds"] for a in answers), 1e-9)


def report(fig: dict) -> str:
    rows = []
    for nice, s in fig["summary"].items():
        rows.append([nice, f"{s['quiet_s']:.2f} s ({s['quiet_tps']:.1f} tok/s)",
                     f"{s['training_s']:.2f} s ({s['training_tps']:.1f} tok/s)" if s.get("training_s") else "–",
                     f"{s['slowdown']:.2f}×" if s.get("slowdown") else "–", s["answers"], s["after"]])
    text = markdown_table(["training worker's nice", "median answer, quiet", "median answer, while training",
                           "slowdown", "answers while training", "ended after it"], rows)
    return text + (f"\n\n{fig['answers']} answers a phase, at most {fig['max_new_tokens']} new tokens, drawn by "
                   f"{fig['engine']}; quiet: before the workers started.")


if __name__ == "__main__":
    main()
