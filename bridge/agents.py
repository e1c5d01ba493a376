"""Install and remove rlfleet's hooks in a coding agent's own settings file.

Claude Code: ``~/.claude/settings.json`` (or ``$CLAUDE_CONFIG_DIR``); Codex: ``~/.codex/hooks.json``
(or ``$CODEX_HOME``). Both read the same shape: ``{"hooks": {EVENT: [{"hooks": [{"type": "command",
"command": ..., "timeout": N}]}]}}``; we add one group to ``UserPromptSubmit`` and one to ``Stop``.

The file is backed up before every change, installing twice changes nothing, other hooks are never
touched, and uninstalling removes exactly ours: when the file is still what we wrote, its original
bytes come back exactly; when someone edited it since, only our entries are taken out.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.shared.errors import BadInput

MARKER = "rlfleet.bridge.hook"
EVENTS = (("UserPromptSubmit", "prompt"), ("Stop", "stop"))
HOOK_TIMEOUT_S = 10  # ours return in milliseconds; this only bounds a pathological case


@dataclass(frozen=True)
class Agent:
    name: str
    path: Path  # the settings file
    note: str  # what the user still has to do, if anything


def agent(name: str) -> Agent:
    if name == "claude-code":
        folder = Path(os.environ.get("CLAUDE_CONFIG_DIR") or Path.home() / ".claude")
        return Agent(name, folder / "settings.json", "")
    if name == "codex":
        folder = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex")
        return Agent(name, folder / "hooks.json",
                     "Codex runs new hooks only once you trust them: type /hooks in Codex and approve rlfleet's")
    raise BadInput(f"unknown agent {name!r}: use claude-code or codex")


def hook_command(name: str, event: str, home: Path | None) -> str:
    cmd = f"{shlex.quote(sys.executable)} -m {MARKER} {name} {event}"
    return f"RLFLEET_HOME={shlex.quote(str(home))} {cmd}" if home is not None else cmd


def _ours(handler: object) -> bool:
    return isinstance(handler, dict) and MARKER in str(handler.get("command", ""))


def _dump(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode()


def _load(path: Path) -> tuple[bytes | None, dict]:
    if not path.exists():
        return None, {}
    raw = path.read_bytes()
    try:
        data = json.loads(raw or b"{}")
    except ValueError:
        raise BadInput(f"{path} is not valid JSON; fix it first (nothing was changed)") from None
    if not isinstance(data, dict) or not isinstance(data.get("hooks", {}), dict) \
            or not all(isinstance(groups, list) for groups in data.get("hooks", {}).values()):
        raise BadInput(f"{path} does not look like a settings file with a hooks object of lists; nothing was "
                       "changed")
    return raw, data


def check(name: str) -> Agent:
    """The agent ``name`` if its settings file can take our hooks; BadInput, changing nothing, if not
    (asked before a command writes anything of its own)."""
    a = agent(name)
    _load(a.path)
    return a


def _write(path: Path, raw: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        shutil.copy2(path, path.with_name(f"{path.name}.rlfleet-backup-{time.strftime('%Y%m%d-%H%M%S')}"))
    tmp = path.with_name(path.name + ".rlfleet-tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)


def _state_path(home: Path, name: str) -> Path:
    return home / "agents" / f"{name}.json"


def install(name: str, home: Path, custom_home: bool) -> tuple[Agent, bool]:
    """Add our hooks; ``(agent, changed)``."""
    a = agent(name)
    original, data = _load(a.path)
    hooks = data.setdefault("hooks", {})
    changed = False
    for event, ours in EVENTS:
        groups = hooks.setdefault(event, [])
        command = hook_command(name, ours, home if custom_home else None)
        mine = [h for g in groups if isinstance(g, dict) for h in g.get("hooks", []) if _ours(h)]
        if mine and all(h.get("command") == command for h in mine):
            continue
        for g in groups:  # an older install (another python, another data dir): replace it
            if isinstance(g, dict):
                g["hooks"] = [h for h in g.get("hooks", []) if not _ours(h)]
        groups[:] = [g for g in groups if not isinstance(g, dict) or g.get("hooks")]
        groups.append({"hooks": [{"type": "command", "command": command, "timeout": HOOK_TIMEOUT_S}]})
        changed = True
    if not changed:
        return a, False
    raw = _dump(data)
    _write(a.path, raw)
    state = _state_path(home, name)
    state.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    previous = json.loads(state.read_text()) if state.exists() else {}
    keep = previous.get("original") if previous.get("path") == str(a.path) and original is not None \
        and hashlib.sha256(original).hexdigest() == previous.get("written") else \
        (base64.b64encode(original).decode() if original is not None else None)
    state.write_text(json.dumps({"path": str(a.path), "original": keep,
                                 "written": hashlib.sha256(raw).hexdigest()}))
    return a, True


def uninstall(name: str, home: Path) -> tuple[Agent, bool]:
    """Remove exactly our hooks; ``(agent, changed)``."""
    a = agent(name)
    current, data = _load(a.path)
    state_path = _state_path(home, name)
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    if current is None:
        state_path.unlink(missing_ok=True)
        return a, False
    if state.get("path") == str(a.path) and hashlib.sha256(current).hexdigest() == state.get("written"):
        original = state.get("original")
        if original is None:
            shutil.copy2(a.path, a.path.with_name(f"{a.path.name}.rlfleet-backup-{time.strftime('%Y%m%d-%H%M%S')}"))
            a.path.unlink()
        else:
            _write(a.path, base64.b64decode(original))
        state_path.unlink()
        return a, True
    hooks = data.get("hooks", {})
    found = False
    for event, _ in EVENTS:
        groups = hooks.get(event)
        if not isinstance(groups, list):
            continue
        for g in groups:
            if isinstance(g, dict) and any(_ours(h) for h in g.get("hooks", [])):
                found = True
                g["hooks"] = [h for h in g["hooks"] if not _ours(h)]
        groups[:] = [g for g in groups if not isinstance(g, dict) or g.get("hooks")]
        if not groups:
            del hooks[event]
    if not found:
        return a, False
    if not hooks:
        del data["hooks"]
    _write(a.path, _dump(data))
    state_path.unlink(missing_ok=True)
    return a, True
