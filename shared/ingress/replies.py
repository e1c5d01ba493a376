"""What a front end says back when it has no wording of its own: refusals, the worker's answer to an
event, and the one-paragraph status. Standard library only (the hooks use it too)."""

from __future__ import annotations

NOTHING_TO_RATE = "nothing of yours to rate here"
NOT_YOURS = "only the person the bot answered (or an allowlisted rater) can rate this answer"
WHY_USAGE = "say why after /rl why, e.g. /rl why too long: it becomes the reason of your last rating here"
NOT_YET_RECORDED = "noted; it will be recorded when the rlfleet worker gets to it"
NO_STATUS = "no status yet: is the rlfleet worker running (`rlfleet up`)?"


def admins_only(verb: str) -> str:
    return f"/rl {verb} is for admins only"


def worker_answer(result: dict | None) -> str:
    """The worker's answer to an event in one line (None: it did not come in time)."""
    if result is None:
        return NOT_YET_RECORDED
    msg = str(result.get("message") or ("done" if result.get("ok") else "failed"))
    if result.get("training"):
        msg += f" · {result['training']}"
    return msg


def status_line(st: dict | None) -> str:
    """The one-paragraph status a chat user sees (the full dict is `rlfleet status --json`)."""
    if not st:
        return NO_STATUS
    current = (st.get("adapter") or {}).get("current") or "the base model"
    r = st.get("ratings") or {}
    t = st.get("training") or {}
    line = (f"serving {current} of {st.get('model')} · {r.get('total', 0)} ratings "
            f"({r.get('good', 0)} good, {r.get('bad', 0)} bad), {r.get('pending', 0)}/{st.get('threshold')} "
            "toward the next training run")
    state = t.get("state")
    if state == "running" and t.get("progress"):
        p = t["progress"]
        line += f" · training {p.get('phase') or ''} {p.get('step', 0)}/{p.get('total', 0)}".rstrip()
    elif state in ("queued", "running"):
        line += f" · training {state}"
    elif state == "failed" and t.get("error"):
        line += f" · last run: {t['error']}"
    if t.get("paused"):
        line += " · training paused: no run starts by itself until an admin's /rl resume"
    return line
