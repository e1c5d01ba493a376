"""``python -m rlfleet.worker [--queue events|train|all] [--burst]``: one RQ worker in the foreground,
what ``chat`` and ``up`` start as their children (and ``rlfleet worker`` runs); it stops when the
parent that started it is gone."""

from __future__ import annotations

import argparse
import sys

from rlfleet.shared.allocator import preload
from rlfleet.shared.config import data_dir, load_config
from rlfleet.shared.errors import BadInput, RlfleetError
from rlfleet.shared.home import check_home, open_home
from rlfleet.shared.lifecycle import interrupt_on_stop_signals, stop_with_parent
from rlfleet.worker.runner import QUEUES, run_worker


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rlfleet.worker",
        description="Run one worker in the foreground (for scale-out: many events workers, one trainer per model).",
    )
    p.add_argument("--queue", default="all", help="events | train | all")
    p.add_argument("--burst", action=argparse.BooleanOptionalAction, default=False,
                   help="Quit when the queues are empty.")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    interrupt_on_stop_signals()
    try:
        home = data_dir()
        check_home(home)
        if args.queue not in QUEUES:
            raise BadInput(f"unknown queue {args.queue!r}: use events, train or all")
        if open_home(home, read_only=False):
            print(f"new data dir created at {home}", file=sys.stderr)
        cfg = load_config()
        if args.queue in ("train", "all"):
            preload(cfg.train.allocator)  # (an exec: this process starts again with it preloaded)
        run_worker(cfg, args.queue, burst=args.burst)
    except RlfleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    stop_with_parent()
    main()
