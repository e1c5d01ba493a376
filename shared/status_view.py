"""The status object as a terminal shows it: ``rlfleet status``, the live panel of ``rlfleet up``, the
chat's ``/rl status``, and the version table of ``rlfleet history``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.table import Table
from rich.text import Text


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


def versions_table(versions: list[dict], title: str | None = None) -> VersionsTable:
    """One row per version, fitted to the terminal; the rest is in --json and meta.json."""
    return VersionsTable(history_rows(versions), title)


# Columns a narrow terminal gives up first: the version, its status, the held-out margin and the
# verdict are what a person reads the table for.
_DROP_ORDER = ("acc tok", "hints", "KL", "ratings", "created")


@dataclass(frozen=True)
class VersionsTable:
    """The table of versions with one line per version, its cells never wrapped, and the columns a
    terminal has no room for left out; a verdict's reason goes under the table, wrapped to the width,
    where it cannot squeeze the columns into a column of single words."""

    rows: list[dict]
    title: str | None = None

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        columns = _version_columns(self.rows)
        table = _table(columns, self.title)
        unbounded = options.update_width(10_000)  # a measurement is clamped to the width it is given
        for name in _DROP_ORDER:
            if console.measure(table, options=unbounded).maximum <= options.max_width:
                break
            columns = [c for c in columns if c[0] != name]
            table = _table(columns, self.title)
        yield table
        for r in self.rows:
            note = _verdict_note(r)
            if note:
                yield Text(f"{r['version']} {r['verdict'] or r['status']}{note}", overflow="fold")


def _table(columns: list[tuple[str, list[str]]], title: str | None) -> Table:
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, title=title, title_justify="left")
    for name, _ in columns:
        t.add_column(name, no_wrap=True, overflow="ellipsis")
    for cells in zip(*(cells for _, cells in columns), strict=True):
        t.add_row(*cells)
    return t


def _version_columns(rows: list[dict]) -> list[tuple[str, list[str]]]:
    def margin(r: dict) -> str:
        before, after = r["heldout_margin_before"], r["heldout_margin_after"]
        return f"{before:+.3f} → {after:+.3f}" if before is not None and after is not None else "–"

    def kl(r: dict) -> str:
        return _fmt(r["heldout_kl"] if r["heldout_kl"] is not None else r["final_mean_kl"], 3)

    columns = [
        ("version", [r["version"] for r in rows]),
        ("status", [r["status"] for r in rows]),
        ("created", [(r["created"] or "")[5:16].replace("T", " ") for r in rows]),
        ("ratings", [_ratings(r["ratings_used"], r["replayed"]) for r in rows]),
        ("held-out margin", [margin(r) for r in rows]),
        ("KL", [kl(r) for r in rows]),
        ("acc tok", [_fmt(r["accepted_token_frac"], 2) for r in rows]),
        # The hindsight teacher's column only where a run read words.
        *([("hints", [_hints(r["hint_taught"], r["hinted"], r["teacher_gap"]) for r in rows])]
          if any(r["hinted"] for r in rows) else []),
        ("verdict", [(r["verdict"] or "") + (" *" if _verdict_note(r) else "") for r in rows]),
    ]
    return [(name, [escape(c) for c in cells]) for name, cells in columns]


def _verdict_note(r: dict) -> str:
    """What the verdict word alone does not say: served from halfway through the run, nearer what the
    held-out words asked, or why a version is not the active one."""
    note = ""
    if r["fallback"] == "halfway":  # the whole run was refused; the step from halfway through it passed
        note += f" (step {r['steps_served']}, halfway)"
    if r["heldout_toward_teacher"] and r["verdict"] == "promoted":
        note += (f" (nearer what the words asked: {_fmt(r['heldout_teacher_div_before'])} → "
                 f"{_fmt(r['heldout_teacher_div_after'])})")
    if r["reason"] and r["status"] != "active":
        note += f": {r['reason']}"
    return note


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
