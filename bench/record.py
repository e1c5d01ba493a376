"""Where the systems benchmarks write their figures: a dated block appended to bench/RESULTS.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
APPENDED = "## Runs appended by the benchmark scripts"


def machine() -> str:
    """Date, host, processor count, accelerator and library versions: what a figure was taken on."""
    parts = [time.strftime("%Y-%m-%d"), platform.node() or "?", f"{os.cpu_count()} CPUs"]
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name())
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    parts.append(f"Python {platform.python_version()}")
    return " · ".join(parts)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def append(title: str, body: str, path: Path = RESULTS) -> None:
    """Append ``body`` under a dated heading naming the command that made it."""
    command = "python -m " + " ".join([_module()] + [shlex.quote(a) for a in sys.argv[1:]])
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if APPENDED not in text:
        text = text.rstrip("\n") + f"\n\n{APPENDED}\n\nNewest last; each block is one run, verbatim.\n"
    text = text.rstrip("\n") + f"\n\n### {title} · {machine()}\n\n```\n{command}\n```\n\n{body.rstrip()}\n"
    path.write_text(text)


def _module() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else Path(sys.argv[0]).stem


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first paragraph as the description, the rest as the
    epilog (``--help`` then explains what is measured and how)."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(prog=f"python -m {module}", description=head, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def output_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--no-record", action="store_true", help="do not append the table to bench/RESULTS.md")


def publish(figures: dict, text: str, args: argparse.Namespace, title: str) -> None:
    """Print the figures (``--json``) or the table, and append the table to RESULTS.md (unless
    ``--no-record``)."""
    print(json.dumps(figures) if args.json else text)
    if not args.no_record:
        append(title, text)


def stop_processes(procs: Sequence[subprocess.Popen], grace: float = 15.0) -> None:
    """SIGTERM every worker a benchmark started (so they finish the job in hand), then SIGKILL the ones
    still running after ``grace`` seconds."""
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
