"""python -m bench.learning.grid run|report: many benchmark configurations at once.

`run` starts one `python -m bench.learning ... --json` process per point of the grid (preferences ×
objectives × presets × thresholds × seeds), `--jobs` at a time, and keeps each one's JSON and log in
`--out`: a GPU box with many cores answers for many simulated users side by side. `report` reads such
a folder (or several) and prints one markdown table per preference, runs of the same variant with
different seeds pooled (`--per-seed`: a row each), and writes one PNG plot per preference.

    python -m bench.learning.grid run --preference short:30 --preference question \\
        --objective mispo,soft,reinforce,kto --ratings 128 --jobs 16 --out runs/
    python -m bench.learning.grid report runs/ --plots bench/learning/plots
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .report import markdown_table, plot, pool, slug

OBJECTIVES = ("mispo", "soft", "reinforce", "kto")


@dataclass(frozen=True)
class Point:
    preference: str
    objective: str
    preset: str
    threshold: int
    seed: int

    def name(self, extra: list[str] | None = None) -> str:
        """The file stem of this point's results; options passed through to every run change it too,
        so a resumed grid never takes a run made with other options for one of its own."""
        stem = f"{slug(self.preference)}__{self.objective}__{self.preset}__t{self.threshold}__s{self.seed}"
        return stem + (f"__x{hashlib.sha1(' '.join(extra).encode()).hexdigest()[:6]}" if extra else "")

    def argv(self, ratings: int, extra: list[str]) -> list[str]:
        return [
            sys.executable, "-m", "bench.learning", "--preference", self.preference, "--objective", self.objective,
            "--preset", self.preset, "--threshold", str(self.threshold), "--seed", str(self.seed),
            "--ratings", str(ratings), "--json", *extra,
        ]  # fmt: skip


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def points(prefs: list[str], objectives: list[str], presets: list[str], thresholds: list[int],
           seeds: list[int]) -> list[Point]:
    return [Point(*p) for p in itertools.product(prefs, objectives, presets, thresholds, seeds)]


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    bad = [o for o in args.objective if o not in OBJECTIVES]
    if bad:
        console.print(f"[red]error:[/] unknown objective {bad[0]!r}; choose from {', '.join(OBJECTIVES)}")
        return 2
    grid = points(args.preference, args.objective, args.preset, args.threshold, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = [p for p in grid if not (args.out / f"{p.name(args.extra)}.json").is_file()]  # a rerun resumes
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.threads:  # many processes on one box: keep each from claiming every core
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    running: dict[Point, tuple[subprocess.Popen, float]] = {}
    failed: list[str] = []
    deadline = time.monotonic() + args.timeout if args.timeout else None
    # A grid stopped by a signal stops its runs too: each would otherwise go on for its whole length
    # beside whatever runs next.
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task("benchmark runs", total=len(grid), completed=len(grid) - len(todo))
            while todo or running:
                while todo and len(running) < args.jobs:
                    p = todo.pop(0)
                    log = open(args.out / f"{p.name(args.extra)}.log", "w")  # noqa: SIM115 - closed with the process
                    out = open(args.out / f"{p.name(args.extra)}.json.part", "w")  # noqa: SIM115
                    proc = subprocess.Popen(p.argv(args.ratings, args.extra), stdout=out, stderr=log, env=env)
                    running[p] = (proc, time.monotonic())
                for p, (proc, _) in list(running.items()):
                    if proc.poll() is None:
                        if deadline and time.monotonic() > deadline:
                            stop(proc)
                        continue
                    del running[p]
                    name = p.name(args.extra)
                    part = args.out / f"{name}.json.part"
                    if proc.returncode == 0:
                        part.rename(args.out / f"{name}.json")
                    else:
                        failed.append(f"{name} (exit {proc.returncode}; see {name}.log)")
                        part.unlink(missing_ok=True)
                    bar.advance(task)
                time.sleep(0.5)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc, _ in running.values():
            stop(proc)
    for f in failed:
        console.print(f"[red]failed:[/] {f}")
    return 1 if failed else 0


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Stop a benchmark run: an interrupt first, so that it shuts down what it started (its embedded
    Redis server), then a kill if it has not ended within ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def load(folders: list[Path]) -> list[dict]:
    out = []
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            out.append(json.loads(f.read_text()))
    return out


def _recorded(s: dict) -> dict:
    """The settings a run's first training run recorded (empty in the JSON of older runs)."""
    return next((r["train"] for r in s.get("runs") or [] if r.get("train")), {})


def settings(s: dict) -> dict:
    """What a run trained with: the settings it recorded, with the command line's overrides on top
    (older JSON has only those)."""
    return {**_recorded(s), **(s.get("overrides") or {})}


PRESET = object()  # a setting left at the preset's value, where the run did not record which


def _labelled(summaries: list[dict]) -> list[dict]:
    """Label each run by what varies between the runs of its preference (seeds pool, so not by seed).
    A setting an older run's JSON does not record reads ``preset`` (the preset of that commit)."""
    keys = ("objective", "preset", "threshold")
    varying = [k for k in keys if len({s.get(k) for s in summaries}) > 1] or ["objective"]
    names = {"objective": "{}", "preset": "{}", "threshold": "t={}"}
    # A run whose JSON records no settings ran the preset's value of every setting it did not override:
    # that is a value for the settings some run overrode, and unknown for the rest (so older JSON does
    # not make every setting a newer run records look varied).
    overridden = {k for s in summaries for k in s.get("overrides") or {}}
    # A run that records its settings but not one a newer run records ran before that setting existed:
    # a different value (read "preset"), unlike a run that records none, whose values are unknown.
    newer = {k for s in summaries if _recorded(s) for k in settings(s)}
    own = [{k: PRESET for k in newer} | settings(s) if _recorded(s) else {k: PRESET for k in overridden} | settings(s)
           for s in summaries]
    varied = sorted(k for k in {k for o in own for k in o} if len({repr(o[k]) for o in own if k in o}) > 1)

    def value(v: object) -> str:
        if v is PRESET:
            return "preset"
        if isinstance(v, bool):
            return "on" if v else "off"
        return f"{v:g}" if isinstance(v, (int, float)) else str(v)  # lr=5e-05, advantage=asymmetric

    def name(s: dict, o: dict) -> str:
        parts = [names[k].format(s.get(k)) for k in varying]
        return " · ".join(parts + [f"{k}={value(o[k])}" if k in o else f"{k}=preset" for k in varied])

    return [{**s, "label": name(s, o)} for s, o in zip(summaries, own, strict=True)]


def report(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    summaries = load(args.folders)
    if not summaries:
        console.print(f"[red]error:[/] no benchmark JSON in {', '.join(map(str, args.folders))}")
        return 2
    by_pref: dict[str, list[dict]] = defaultdict(list)
    for s in summaries:
        by_pref[s["preference"]].append(s)
    for pref, group in by_pref.items():
        labelled = _labelled(group)
        if args.per_seed:  # a row per run: what pooling would hide (one lucky seed, one that loops)
            labelled = [{**s, "label": f"{s['label']} · seed {s.get('seed')}"} for s in labelled]
        rows = pool(labelled)
        order = {o: i for i, o in enumerate(OBJECTIVES)}
        rows.sort(key=lambda s: (order.get(s["objective"], 9), s["label"]))
        print(f"\n### {pref} · {rows[0]['ratings']} ratings\n")
        print(markdown_table(rows))
        if args.plots:
            written = plot(rows, args.plots / f"{slug(pref)}.png")
            console.print(f"plot: {written}" if written else "[yellow]no plot: pip install matplotlib[/]")
    return 0


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.learning.grid", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run every point of a grid, --jobs at a time")
    r.add_argument("--preference", action="append", required=True, help="a named preference (repeatable)")
    r.add_argument("--objective", type=_csv, default=list(OBJECTIVES), help="comma list (default: all four)")
    r.add_argument("--preset", type=_csv, default=["balanced"], help="comma list (default balanced)")
    r.add_argument("--threshold", type=lambda t: [int(x) for x in _csv(t)], default=[32], help="comma list")
    r.add_argument("--seed", type=lambda t: [int(x) for x in _csv(t)], default=[0], help="comma list")
    r.add_argument("--ratings", type=int, default=128)
    r.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="processes at once")
    r.add_argument("--threads", type=int, default=None, help="torch/OMP threads per process")
    r.add_argument("--timeout", type=float, default=None, help="seconds; runs still going then are killed")
    r.add_argument("--out", type=Path, required=True, help="folder for each run's JSON and log")
    r.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more bench.learning options for every run")
    p = sub.add_parser("report", help="tables per preference (seeds pooled) and a PNG plot each")
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--plots", type=Path, help="folder to write one PNG per preference into")
    p.add_argument("--per-seed", action="store_true", help="a row per seed instead of the seeds pooled")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        args.extra = [a for a in args.extra if a != "--"]
        if args.jobs < 1 or args.ratings < 1:
            ap.error("--jobs and --ratings must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    sys.exit(main())
