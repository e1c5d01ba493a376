"""How long a coding-agent hook keeps the agent waiting: `python -m bench.hooks [--n 30]`.

Runs the real hook entry point (a new Python process each time, as the agent does) against a real
bridge on 127.0.0.1 and with the bridge down (spooling), and prints wall-time percentiles."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(home: Path, event: str, payload: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlfleet.bridge.hook", "claude-code", event],
                   input=json.dumps(payload).encode(), capture_output=True, timeout=30,
                   env={**os.environ, "RLFLEET_HOME": str(home)}, check=True)
    return (time.perf_counter() - t0) * 1000


def _row(name: str, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=100)
    return f"| {name} | {len(ms)} | {statistics.median(ms):.0f} | {q[94]:.0f} | {max(ms):.0f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=30, help="runs per case")
    args = ap.parse_args()
    from test_bridge import running  # the tests' thread runner: the bridge on a free port

    from rlfleet.bridge.app import make_app
    from rlfleet.cli.setup import write_secret
    from rlfleet.shared.config import load_config
    from rlfleet.shared.queue import open_queue

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        os.environ["RLFLEET_HOME"] = str(home)
        cfg = load_config(home)
        write_secret(cfg.secret_path)
        handle = open_queue(cfg)
        prompt = {"session_id": "s", "transcript_path": "/nonexistent", "hook_event_name": "UserPromptSubmit",
                  "prompt": "why is the build red?", "prompt_id": "p"}
        stop = {"session_id": "s", "hook_event_name": "Stop", "stop_hook_active": False,
                "last_assistant_message": "The lockfile is stale."}
        rate = {**prompt, "prompt": "/rl good"}
        rows = []
        try:
            with running(make_app(cfg, handle)) as url:
                cfg.bridge.port = int(url.rsplit(":", 1)[1])
                cfg.save()
                for name, event, payload in (("prompt (remembered)", "prompt", prompt),
                                             ("stop (capture via bridge)", "stop", stop),
                                             ("/rl good (via bridge)", "prompt", rate)):
                    rows.append(_row(name, [_run(home, event, payload) for _ in range(args.n)]))
            cfg.bridge.port = 9
            cfg.save()
            rows.append(_row("stop, bridge down (spooled)", [_run(home, "stop", stop) for _ in range(args.n)]))
        finally:
            handle.close()
    print("| hook | runs | p50 ms | p95 ms | max ms |\n|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    main()
