"""The status object as a terminal shows it: ``rlfleet status``, the live panel of ``rlfleet up``, the
chat's ``/rl status``, and the version table of ``rlfleet history``."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Group
from rich.markup import escape
from rich.table import Table


def render_status(st: dict) -> Group:
    t = Table(show_header=False, box=None, pad_edge=False)
    r = st["ratings"]
    t.add_row("model", st["model"])
    t.add_row("ratings", f"{r['total']} ({r['good']} good, {r['bad']} bad), {r['pending']} pending "
              f"of {st['threshold']} to train")
    t.add_row("baseline (EMA)", f"{st['ema']:+.3f}" if st["ema_seeded"] else "not seeded yet")
    t.add_row("adapter", st["adapter"]["current"] or "base model (no adapter)")
    tr = st["training"]
    line = tr["state"]
    if tr.get("progress"):
        p = tr["progress"]
        line += f" · {p['phase']} step {p['step']}/{p['total']} · {p['tokens_per_s']:.0f} tok/s"
    if tr.get("error"):
        line += f" · [red]{escape(tr['error'])}[/]"
    if tr.get("paused"):
        line += " · [yellow]paused[/]: no run starts by itself (`rlfleet resume`; `rlfleet train` still runs one)"
    t.add_row("training", line)
    t.add_row("queue", f"{st['queue']['events']} events, {st['queue']['train']} training jobs waiting")
    if st["queue"].get("dead_letters"):
        t.add_row("set aside", f"[red]{st['queue']['dead_letters']} events the worker failed on[/red]: "
                  "`rlfleet events --dead` shows them, `--retry` tries them again")
    t.add_row("workers", str(st["workers"]))
    for name, b in st.get("bots", {}).items():
        t.add_row(f"bot {name}", bot_line(b))
    if (st.get("durability") or {}).get("warning"):
        t.add_row("durability", f"[yellow]{escape(st['durability']['warning'])}[/]")
    for key, sc in sorted((st.get("scopes") or {}).items()):  # per-person and per-channel adapters
        r = sc["ratings"]
        t.add_row(f"scope {escape(key)}", f"{sc['adapter']['current'] or 'base model'} · {r['total']} ratings "
                                          f"({r['pending']} pending) · {escape(sc['training']['state'])}")
    for p in st.get("push", []):
        mark = {True: "[green]ok[/]", False: "[red]failed[/]", None: "[yellow]manual[/]"}[p["ok"]]
        t.add_row(f"push {p['target']}", f"{mark} {p['version'] or 'base'} · {escape(p['message'])}")
    versions = st["adapter"]["versions"]
    if not versions:
        return Group(t)
    return Group(t, versions_table(versions[-10:], title="versions (newest last)"))


def bot_line(b: dict) -> str:
    """connected / retrying since when / not running, and the last error with its time."""
    colour = {"connected": "green", "retrying": "yellow"}.get(b["state"], "red")
    line = f"[{colour}]{b['state']}[/]"
    if b.get("since"):
        line += f" since {b['since'][:19].replace('T', ' ')} UTC"
    if b.get("last_error"):
        line += f" · last error {b['last_error_at'][11:19]}: {escape(b['last_error'])}"
    return line


HISTORY_FIELDS = ("ratings_used", "replayed", "heldout_n", "heldout_margin_before", "heldout_margin_after",
                  "heldout_kl", "final_mean_kl", "accepted_token_frac", "accepted_seq_frac", "reward_model_auc",
                  "explored", "explore_reason", "verdict", "reason", "fallback", "steps_served", "refused_full",
                  "hinted", "hint_taught", "teacher_gap",
                  # held-out ratings all of one class, with words: the teacher reading them vouched (worker/gate.py)
                  "heldout_toward_teacher", "heldout_teacher_div_before", "heldout_teacher_div_after")


def history_rows(versions: list[dict]) -> list[dict]:
    return [
        {"version": v["version"], "status": v["status"], "created": v["created"], "parent": v.get("parent"),
         **{k: v["metrics"].get(k) for k in HISTORY_FIELDS}}
        for v in versions
    ]


def versions_table(versions: list[dict], title: str | None = None) -> Table:
    """One row per version, narrow enough for 80 columns (the rest is in --json and meta.json)."""
    rows = history_rows(versions)
    # The hindsight teacher's column only where a run read words: the table stays within 80 columns.
    hints = any(r["hinted"] for r in rows)
    t = Table("version", "status", "created", "ratings", "held-out margin", "KL", "acc tok",
              *(("hints",) if hints else ()), "verdict",
              box=box.SIMPLE_HEAD, pad_edge=False, title=title, title_justify="left")
    for r in rows:
        before, after = r["heldout_margin_before"], r["heldout_margin_after"]
        margin = f"{before:+.3f} → {after:+.3f}" if before is not None and after is not None else "–"
        verdict = r["verdict"] or ""
        if r["fallback"] == "halfway":  # the whole run was refused; the step from halfway through it passed
            verdict += f" (step {r['steps_served']}, halfway)"
        if r["heldout_toward_teacher"] and r["verdict"] == "promoted":
            verdict += (f" (nearer what the words asked: {_fmt(r['heldout_teacher_div_before'])} → "
                        f"{_fmt(r['heldout_teacher_div_after'])})")
        if r["reason"] and r["status"] != "active":
            verdict += f": {r['reason']}"
        kl = r["heldout_kl"] if r["heldout_kl"] is not None else r["final_mean_kl"]
        t.add_row(r["version"], r["status"], (r["created"] or "")[5:16].replace("T", " "),
                  _ratings(r["ratings_used"], r["replayed"]), margin, _fmt(kl, 3), _fmt(r["accepted_token_frac"], 2),
                  *((_hints(r["hint_taught"], r["hinted"], r["teacher_gap"]),) if hints else ()), escape(verdict))
    return t


def _ratings(used: Any, replayed: Any) -> str:
    """``32``, or ``32 +16`` when the run also replayed 16 earlier ratings."""
    return str(used or "") + (f" +{replayed}" if replayed else "")


def _hints(taught: Any, hinted: Any, gap: Any) -> str:
    """``12/16 +0.041``: ratings the hindsight teacher taught from of those with words, and its mean gap
    (worker/training/hindsight.py); empty for a run with no words to read, or with hindsight off."""
    if not hinted:
        return ""
    return f"{taught or 0}/{hinted}" + (f" {gap:+.3f}" if isinstance(gap, (int, float)) else "")


def _fmt(v: Any, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, (int, float)) else ""
