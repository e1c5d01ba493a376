"""The comparison's table (markdown) and plot (PNG, when matplotlib is installed), and the pooling
of repeated runs (seeds) of one variant into one row."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from statistics import fmean

from .metrics import wilson


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None or x != x else format(x, fmt)


def _percent(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f} %"


def slug(name: str) -> str:
    """A preference spec as a file name: ``short:30`` -> ``short-30``."""
    return "".join(c if c.isalnum() else "-" for c in name)


def label(s: dict) -> str:
    return s.get("label") or s["objective"]


def markdown_table(summaries: list[dict]) -> str:
    head = ("| variant | ratings | seeds | rate before | rate after | Δ | 95 % CI after | margin before → after "
            "| words before → after | distinct-2 after | repeated trigrams before → after | entropy ratio "
            "| runs promoted | teacher rate · gap | seconds |")
    rows = [head, "|" + "---|" * 15]
    for s in summaries:
        lo, hi = s["ci95"]
        promoted = sum(1 for r in s["runs"] if r["state"] == "succeeded")
        halfway = sum(1 for r in s["runs"] if r["state"] == "succeeded" and r.get("fallback") == "halfway")
        rows.append(
            f"| {label(s)} | {s['ratings']} | {s.get('seeds', 1)} "
            f"| {_f(s['base_rate'], '.2f')} | {_f(s['final_rate'], '.2f')} "
            f"| {_f(s['delta'], '+.2f')} | {_f(lo, '.2f')}–{_f(hi, '.2f')} "
            f"| {_f(s['margin_before'], '+.3f')} → {_f(s['margin_after'], '+.3f')} "
            f"| {_f(s['answer_words_before'], '.0f')} → {_f(s['answer_words_after'], '.0f')} "
            f"| {_f(s['distinct2_after'], '.2f')} "
            f"| {_percent(s.get('base_repeat'))} → {_percent(s.get('final_repeat'))} "
            f"| {_f(s['entropy_ratio'], '.2f')} "
            f"| {promoted}/{len(s['runs'])}{f' ({halfway} halfway)' if halfway else ''} "
            f"| {_f(s.get('teacher_rate'), '.2f')} · {_f(s.get('teacher_gap'), '+.3f')} | {s['seconds']:.0f} |"
        )
    return "\n".join(rows)


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return fmean(xs) if xs else float("nan")


def _pool_checkpoints(groups: list[list[dict]]) -> list[dict]:
    """Checkpoints at the same rating count across seeds: rates pooled over every held-out answer
    (so the interval narrows with more seeds), the other figures averaged."""
    out = []
    for cps in zip(*groups, strict=False):
        judged = sum(c["judged"] for c in cps)
        liked = sum(round(c["rate"] * c["judged"]) for c in cps if c["judged"])
        out.append({
            "ratings": cps[0]["ratings"],
            "rate": liked / judged if judged else float("nan"),
            "ci95": list(wilson(liked, judged)),
            "judged": judged,
            **{k: _mean([c.get(k) for c in cps])
               for k in ("margin", "answer_words", "distinct2", "repeat", "entropy_ratio")},
        })
    return out


def pool(summaries: list[dict]) -> list[dict]:
    """One summary per label: runs of the same variant with different seeds pooled, in first-seen order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in summaries:
        groups[label(s)].append(s)
    pooled = []
    for name, members in groups.items():
        if len(members) == 1:
            pooled.append(members[0])
            continue
        cps = _pool_checkpoints([m["checkpoints"] for m in members])
        first, last = cps[0], cps[-1]
        pooled.append({
            **{k: members[0][k] for k in ("preference", "objective", "model", "preset", "threshold")},
            "label": name,
            "seeds": len(members),
            "ratings": last["ratings"],
            "base_rate": first["rate"],
            "final_rate": last["rate"],
            "delta": last["rate"] - first["rate"],
            "ci95": last["ci95"],
            "base_ci95": first["ci95"],
            "margin_before": first["margin"],
            "margin_after": last["margin"],
            "answer_words_before": first["answer_words"],
            "answer_words_after": last["answer_words"],
            "distinct2_before": first["distinct2"],
            "distinct2_after": last["distinct2"],
            "base_distinct2": first["distinct2"],
            "final_distinct2": last["distinct2"],
            "base_repeat": first["repeat"],
            "final_repeat": last["repeat"],
            "entropy_ratio": last["entropy_ratio"],
            "promoted": sum(m.get("promoted", 0) for m in members),
            "runs": [r for m in members for r in m["runs"]],
            "checkpoints": cps,
            "seconds": _mean([m["seconds"] for m in members]),
            # The hindsight teacher (the base reading the hint): its own rate, and the last runs' gap.
            "teacher_rate": _mean([m.get("teacher_rate") for m in members]),
            "teacher_gap": _mean([m.get("teacher_gap") for m in members]),
        })
    return pooled


def plot(summaries: list[dict], path: Path) -> Path | None:
    """Preferred rate (with its interval), margin and repeated trigrams (the fluency the gains must
    keep) against ratings, one line per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    for s in summaries:
        cps = s["checkpoints"]
        x = [c["ratings"] for c in cps]
        ax1.plot(x, [c["rate"] for c in cps], marker="o", label=label(s))
        ax1.fill_between(x, [c["ci95"][0] for c in cps], [c["ci95"][1] for c in cps], alpha=0.12)
        ax2.plot(x, [c["margin"] for c in cps], marker="o", label=label(s))
        repeat = [c.get("repeat") for c in cps]
        if all(r is not None for r in repeat):
            ax3.plot(x, [100 * r for r in repeat], marker="o", label=label(s))
    pref = summaries[0]["preference"] if summaries else ""
    ax1.set(title=f"held-out preferred rate · {pref}", xlabel="ratings", ylabel="rate", ylim=(0, 1))
    ax2.set(title="held-out log-prob margin (good − bad)", xlabel="ratings", ylabel="nats / token")
    ax3.set(title="repeated trigrams in held-out answers", xlabel="ratings", ylabel="%")
    ax1.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
