"""The pooled tables and plots of bench/RESULTS.md, "the halfway step" (2026-11-25, late): runs from
several folders pooled under one label. The shipped defaults' seeds 0 and 2 and `direct` seed 1 are
the unlikelihood runs of the evening, made before train.fallback existed: the gate promoted every
version of those runs, and the fallback acts only on a refusal, so with it they are the same runs
(their first runs and seed 1's, which the fallback changed, agree to the digit).

    python bench/learning/runs/pooled_2026_11_25.py        # from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from bench.learning.report import markdown_table, plot, pool  # noqa: E402

RUNS = ROOT / "bench" / "learning" / "runs"
SHIPPED = "mispo · shipped defaults"
NO_FALLBACK = "mispo · the same, no fallback"
GROUPS = {
    "short:34": {
        SHIPPED: ["2026-11-25-cpu-unlikelihood/short-34__mispo__balanced__t32__s0__x04adca.json",
                  "2026-11-25-cpu-shipped/short-34__mispo__balanced__t32__s1.json",
                  "2026-11-25-cpu-unlikelihood/short-34__mispo__balanced__t32__s2__x04adca.json"],
        NO_FALLBACK: ["2026-11-25-cpu-unlikelihood/short-34__mispo__balanced__t32__s0__x04adca.json",
                      "2026-11-25-cpu-unlikelihood/short-34__mispo__balanced__t32__s1__x04adca.json",
                      "2026-11-25-cpu-unlikelihood/short-34__mispo__balanced__t32__s2__x04adca.json"],
        "kto (TRL's KTOTrainer)": sorted(f"2026-11-25-cpu-kto/{p.name}"
                                         for p in RUNS.glob("2026-11-25-cpu-kto/short-34*.json")),
    },
    "direct": {
        SHIPPED: ["2026-11-25-cpu-shipped/direct__mispo__balanced__t32__s0.json",
                  "2026-11-25-cpu-unlikelihood/direct__mispo__balanced__t32__s1__x04adca.json"],
        "kto (TRL's KTOTrainer)": ["2026-11-25-cpu-kto/direct__kto__balanced__t32__s0.json"],
    },
}


def main() -> None:
    out = ROOT / "bench" / "learning" / "plots" / "2026-11-25-cpu-shipped"
    for pref, variants in GROUPS.items():
        runs = [{**json.loads((RUNS / f).read_text()), "label": label}
                for label, files in variants.items() for f in files]
        rows = pool(runs)
        print(f"\n### {pref} · 64 ratings\n")
        print(markdown_table(rows))
        plot(rows, out / f"{pref.replace(':', '-')}.png")


if __name__ == "__main__":
    main()
