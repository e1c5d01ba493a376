"""Wall time from the threshold-th rating to a served adapter, through the whole pipeline.

Real parts: Redis, an events worker and a training worker as `rlfleet up` starts them, the store
in a fresh data dir, the default model. The answers exist already (answer generation is the chat's
time, not this one's): short answers of about the chat's mean length on CPU (50 tokens, measured by
bench.spine). Ratings alternate good (a clear answer) and bad (an evasive one). For each run, all
but the last rating that reaches the threshold are sent and stored first (after the first run fewer
new ones do: a run's held-out ratings stay pending); the clock starts when the last one is enqueued
and stops when `CURRENT`
names the new version (or the run ends without one: then the verdict says why). The phases come
from the training worker's progress record in Redis (polled every 0.1 s).

Run 1 is the first run of a freshly started training worker (it loads the model as it starts,
`train.preload`, so the load overlaps the time the ratings take to arrive: a minute here by
default, minutes for a real user); later runs are what every run after it costs.

`--history N` starts the user further along: N earlier ratings, already trained on by a served
version (a fresh LoRA: what it answers does not matter to the timing), which every run's reward model
reads (up to 256 of them) beside its own. `--first-after S` and `--between S` set the time a user's
ratings take: the first run's last rating comes S seconds after the workers start, a later run's S
seconds after the run before it ended (default 60 each: a user's ratings take minutes, and the worker's
idle work fills them; 0 is the worst case, every rating at once, which no user rates at).

    python -m bench.time_to_adapter [--threshold 32] [--runs 2] [--history 256] [--between 60] [--json]
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .record import output_options, parser, publish, stop_processes

TOPICS = ["rain", "tea", "maps", "jazz", "bread", "snow", "chess", "kites", "ships", "owls", "silk", "bees"]
FORMS = ["Tell me about {} in two sentences.", "What is {} good for?", "Give me one fact about {}."]
# One consistent taste (the clear answer good, the evasive one bad), as a real user rates: labels that
# contradict each other on one answer make a run the KL check refuses, and nothing would be timed.
GOOD = (
    "{t} is a topic people ask about often. In short, {t} has a long history, a few common uses and "
    "some surprising details that are worth a look if you have a minute to spare today."
)
BAD = (
    "{t}? Hard to say. Some say one thing about {t}, some say another, and I would not like to pick "
    "between them, so you may want to ask someone else about it, or look it up later."
)


# The run's own figures kept beside the phases: its precision and the seconds of the parts inside them.
RUN_METRICS = ("precision", "allocator", "reward_model_seconds", "reward_model_known", "explore_seconds",
               "rewrite_seconds", "teacher_seconds", "loop_seconds", "final_kl_seconds", "explored", "explored_known",
               "loop_checked", "gate_base_known")


def _wait(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what}: nothing after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.time_to_adapter", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--threshold", type=int, default=32, help="ratings per run (default 32, the default threshold)")
    ap.add_argument("--runs", type=int, default=2, help="consecutive runs (default 2)")
    ap.add_argument("--first-after", type=float, default=60.0,
                    help="seconds after the workers start before the first run's last rating is sent: a "
                         "user's first ratings take minutes (default 60; 0: at once)")
    ap.add_argument("--device", default="cpu", help="training device (default cpu)")
    ap.add_argument("--redis", default=None,
                    help="a Redis URL this may flush (default: the embedded one, started for this run)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for one run (default 900)")
    ap.add_argument("--engine", default="auto", choices=["auto", "torch", "llama.cpp"],
                    help="what draws the runs' samples (chat.engine; default auto: llama.cpp where it can run)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads per worker (default: torch's choice, every core)")
    ap.add_argument("--history", type=int, default=0,
                    help="earlier ratings a served version already trained on, as after a few runs "
                         "(default 0: a new user)")
    ap.add_argument("--between", type=float, default=60.0,
                    help="seconds between a run's end and the next run's last rating: a user's next "
                         "ratings take minutes too (default 60; 0: at once)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                    help="a training setting for the runs, as in config.toml's [train] (e.g. "
                         "micro_batch_tokens=1024; repeatable): to compare settings run by run")
    output_options(ap)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.threshold < 1:
        ap.error("--runs and --threshold take a number of 1 or more")
    if not all(0 <= x < math.inf for x in (args.history, args.first_after, args.between)):
        ap.error("--history, --first-after and --between take a number of 0 or more")
    if not 0 < args.timeout < math.inf:
        ap.error("--timeout takes a number of seconds above 0")
    from pydantic import ValidationError

    from rlfleet.shared.config import TrainSettings

    try:
        args.train_settings = dict(_setting(s) for s in args.settings)
        TrainSettings.model_validate(args.train_settings)
    except (ValueError, ValidationError) as exc:
        ap.error(f"--set: {exc}")
    # Stopped with SIGTERM (timeout, kill): unwind through `finally`, which stops the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from rich.console import Console

    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="rlfleet-tta-", ignore_cleanup_errors=True) as tmp:
        return _measure(args, Path(tmp), console)


def _measure(args, home: Path, console) -> dict:
    from rlfleet.shared.config import load_config
    from rlfleet.shared.events import Rating
    from rlfleet.shared.models import model_slug
    from rlfleet.shared.queue import enqueue_event, open_queue, progress_key
    from rlfleet.shared.registry import AdapterRegistry
    from rlfleet.shared.runs import ratings_until_run
    from rlfleet.shared.store import Store

    from .record import markdown_table

    # Without --redis: the embedded server of a fresh data dir, as a new user gets it.
    chosen = {"RLFLEET_HOME": str(home), "RLFLEET_MODEL": args.model}
    if args.redis:
        chosen["REDIS_URL"] = args.redis
    if args.threads:
        chosen.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    os.environ.pop("REDIS_URL", None)
    os.environ.update(chosen)
    env = {**os.environ, **chosen}
    cfg = load_config(home)
    cfg.train.threshold = args.threshold
    cfg.train.device = args.device
    cfg.chat.engine = args.engine
    cfg.train = type(cfg.train).model_validate({**cfg.train.model_dump(), **args.train_settings})
    cfg.save()
    handle = open_queue(cfg)
    if args.redis:
        handle.redis.flushdb()
    store = Store(cfg.db_url)
    slug = model_slug(cfg.model)
    registry = AdapterRegistry(cfg.adapters_root, slug)
    seed_answers(store, cfg.model, args.threshold * args.runs)
    if args.history:
        seed_history(cfg, store, registry, slug, args.history)
        console.print(f"{args.history} earlier ratings, trained on by {registry.current()}")
    logs = open(home / "workers.log", "ab")
    procs = start_workers(env, logs)
    workers_started = time.monotonic()
    runs: list[dict] = []
    try:
        sent, ended_at = 0, 0.0
        for r in range(args.runs):
            # The worker's own rule: a run's held-out slice stays pending (it trains the next run), so
            # after the first run fewer than `threshold` new ratings start one; after a refused run,
            # half a threshold of new ones.
            need = max(1, ratings_until_run(store, slug, args.threshold))
            ratings = [Rating(target=f"c{i}", value=1 if i % 2 == 0 else -1) for i in range(sent, sent + need)]
            sent += need
            for ev in ratings[:-1]:
                enqueue_event(handle, ev)
            _wait(lambda s=sent - 1: store.counts(slug).total >= s, 120, "ratings stored")
            if r == 0:
                time.sleep(max(0.0, workers_started + args.first_after - time.monotonic()))
            else:
                time.sleep(max(0.0, ended_at + args.between - time.monotonic()))
            before = registry.current()
            last_run = store.latest_run(slug)
            t0 = time.monotonic()
            enqueue_event(handle, ratings[-1])
            console.print(f"run {r + 1}: rating {args.threshold} sent ({need} new), waiting for the adapter")
            phases: dict[str, float] = {}

            ended: dict[str, float] = {}

            def finished(last=last_run, before=before, phases=phases, t0=t0, ended=ended):
                got = handle.redis.hget(progress_key(slug), "phase")
                if got:
                    phases.setdefault(got.decode(), time.monotonic() - t0)
                if registry.current() != before:
                    return "served"
                run = store.latest_run(slug)
                if run is not None and (last is None or run.id != last.id) and run.state not in ("queued", "running"):
                    # A promoted run's state is committed just before CURRENT names its version.
                    since = ended.setdefault(run.state, time.monotonic())
                    if run.state != "succeeded" or time.monotonic() - since > 10:
                        return run.state
                return None

            outcome = _wait(finished, args.timeout, f"run {r + 1}")
            ended_at = time.monotonic()
            total = ended_at - t0
            run = store.latest_run(slug)
            metrics = run.metrics or {}
            runs.append({
                "run": r + 1, "outcome": outcome, "seconds": total, "phases": phases,
                "version": run.version, "verdict": metrics.get("verdict"), "reason": metrics.get("reason"),
                "train_seconds": metrics.get("seconds"), "tokens_per_s": metrics.get("tokens_per_s"),
                "steps": metrics.get("steps"), "ratings_used": metrics.get("ratings_used"),
                # Where a run's own clock says its time went (the run's metrics: absent where off).
                **{k: metrics[k] for k in RUN_METRICS if metrics.get(k) is not None},
            })
            console.print(f"run {r + 1}: {outcome} after {total:.1f} s")
    finally:
        stop_processes(procs)
        if args.redis:
            handle.redis.flushdb()
        handle.close()

    rows = [[r["run"], "first" if r["run"] == 1 else "later", r["outcome"], f"{r['seconds']:.1f} s",
             spans(r["phases"], r["seconds"]), r["ratings_used"], r["steps"],
             f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "–"] for r in runs]
    text = markdown_table(["run", "of the worker", "outcome", "threshold-th rating → served", "phases (s)",
                           "ratings trained", "steps", "train tokens/s"], rows)
    figures = {"model": args.model, "threshold": args.threshold, "device": args.device, "engine": args.engine,
               "history": args.history, "between": args.between, "runs": runs}
    if args.train_settings:
        figures["settings"] = args.train_settings
    publish(figures, text, args, f"`bench.time_to_adapter` · {args.model} · threshold {args.threshold} · "
            f"{args.device} · engine {args.engine} · first run's last rating {args.first_after:.0f} s after start"
            + (f" · threads {args.threads}" if args.threads else "")
            + (f" · {args.history} earlier ratings" if args.history else "")
            + (f" · {args.between:.0f} s between runs" if args.between else "")
            + "".join(f" · {k} = {v}" for k, v in args.train_settings.items()))
    return figures


def start_workers(env: dict, log) -> list[subprocess.Popen]:
    """An events and a training worker as `rlfleet up` starts them, their output appended to ``log``."""
    return [subprocess.Popen([sys.executable, "-m", "rlfleet.worker", "--queue", q], env=env, stdout=log,
                             stderr=log) for q in ("events", "train")]


def seed_answers(store, model: str, n: int) -> None:
    """Captures c0 .. c{n-1}: even ones the clear answer, odd ones the evasive one (a rating of 1 and -1
    each is the consistent taste)."""
    from rlfleet.shared.events import Capture, Message

    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        store.apply_capture(Capture(
            capture_id=f"c{i}", prompt=[Message(role="user", content=FORMS[i % len(FORMS)].format(topic))],
            response=(GOOD if i % 2 == 0 else BAD).format(t=topic.capitalize()), model=model,
        ))


def seed_history(cfg, store, registry, slug: str, n: int) -> None:
    """``n`` rated answers, consumed by a promoted run whose version is a fresh LoRA (the base's
    answers), served: the store and the registry as a user's are after a few runs, without the time
    of training them (the timing does not depend on what the version learned)."""
    from rlfleet.shared.events import Capture, Message, Rating
    from rlfleet.worker import trainer_cache
    from rlfleet.worker.presets import for_trainer

    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        store.apply_capture(Capture(
            capture_id=f"h{i}", model=cfg.model, response=(GOOD if i % 2 == 0 else BAD).format(t=topic.capitalize()),
            prompt=[Message(role="user", content=f"{FORMS[i % len(FORMS)].format(topic)} (question {i})")],
        ))
        store.apply_rating(Rating(target=f"h{i}", value=1 if i % 2 == 0 else -1), slug)
    rows = store.pending_ratings(slug, n)
    run_id = store.create_run(slug)
    store.start_run(run_id, None)
    trainer = trainer_cache.get_trainer(cfg)
    tcfg = for_trainer(cfg.train, trainer)
    version = registry.next_version()
    staging = registry.staging(version)
    with trainer.adapter(None, tcfg, trainable=True):
        trainer.save(staging)
    registry.commit(staging, version, {"version": version, "parent": None, "seeded_by": "bench.time_to_adapter"})
    store.finish_run(run_id, model=slug, version=version, parent=None, metrics={},
                     advantages={rating.id: 0.0 for rating, _ in rows}, retracted=[], new_ema=0.0, promote=True)
    registry.set_current(version)
    trainer_cache.forget_trainers()  # the workers load their own


def _setting(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` as a pair (the value is validated with the rest of [train])."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set takes KEY=VALUE, not {text!r}")
    return key.strip(), value.strip()


def spans(phases: dict[str, float], total: float) -> str:
    """``phases`` (each phase's first sighting, seconds after the clock started) as the time spent in
    each, in the order the run went through them, the last one running to ``total``; what came before
    the first sighting is ``queued``. Ordered by time, not by a list of names: a phase this benchmark
    has not heard of keeps its own span instead of being counted in the one before it."""
    seen = sorted(phases.items(), key=lambda kv: kv[1])
    if not seen:  # a run over before the progress record was read once
        return ""
    out = [f"queued {seen[0][1]:.1f}"]
    for (k, t), nxt in zip(seen, [*(t for _, t in seen[1:]), total], strict=True):
        out.append(f"{k} {nxt - t:.1f}")
    return " · ".join(out)


if __name__ == "__main__":
    main()
