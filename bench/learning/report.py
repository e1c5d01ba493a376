"""The comparison's table (markdown) and plot (PNG, when matplotlib is installed)."""

from __future__ import annotations

from pathlib import Path


def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None or x != x else format(x, fmt)


def markdown_table(summaries: list[dict]) -> str:
    head = ("| objective | ratings | rate before | rate after | Δ | 95 % CI after | margin before → after "
            "| words before → after | distinct-2 after | entropy ratio | runs promoted | seconds |")
    rows = [head, "|" + "---|" * 12]
    for s in summaries:
        lo, hi = s["ci95"]
        promoted = sum(1 for r in s["runs"] if r["state"] == "succeeded")
        rows.append(
            f"| {s['objective']} | {s['ratings']} | {_f(s['base_rate'], '.2f')} | {_f(s['final_rate'], '.2f')} "
            f"| {_f(s['delta'], '+.2f')} | {_f(lo, '.2f')}–{_f(hi, '.2f')} "
            f"| {_f(s['margin_before'], '+.3f')} → {_f(s['margin_after'], '+.3f')} "
            f"| {_f(s['answer_words_before'], '.0f')} → {_f(s['answer_words_after'], '.0f')} "
            f"| {_f(s['distinct2_after'], '.2f')} | {_f(s['entropy_ratio'], '.2f')} "
            f"| {promoted}/{len(s['runs'])} | {s['seconds']:.0f} |"
        )
    return "\n".join(rows)


def plot(summaries: list[dict], path: Path) -> Path | None:
    """Preferred rate (with its interval) and margin against ratings, one line per objective."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for s in summaries:
        cps = s["checkpoints"]
        x = [c["ratings"] for c in cps]
        ax1.plot(x, [c["rate"] for c in cps], marker="o", label=s["objective"])
        ax1.fill_between(x, [c["ci95"][0] for c in cps], [c["ci95"][1] for c in cps], alpha=0.12)
        ax2.plot(x, [c["margin"] for c in cps], marker="o", label=s["objective"])
    pref = summaries[0]["preference"] if summaries else ""
    ax1.set(title=f"held-out preferred rate · {pref}", xlabel="ratings", ylabel="rate", ylim=(0, 1))
    ax2.set(title="held-out log-prob margin (good − bad)", xlabel="ratings", ylabel="nats / token")
    ax1.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
