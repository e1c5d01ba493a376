"""Where the systems benchmarks write their figures: a dated block appended to bench/RESULTS.md."""

from __future__ import annotations

import os
import platform
import shlex
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
