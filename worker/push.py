"""After a promotion (or a rollback), hand the served adapter to the inference servers people use.

- vLLM (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``--max-lora-rank`` >= our
  rank): ``POST /v1/load_lora_adapter`` under one stable name with ``load_inplace`` (servers older
  than that flag get an unload, then a load); rolling back to the base unloads the name.
- Ollama: a model ``<base>-rlfleet`` made from the base (which stays untouched). Servers before
  0.34.1 take the peft adapter itself (blobs + ``/api/create`` with ``adapters``); from 0.34.1 Ollama
  refuses adapters, so the adapter is merged into the base and converted to GGUF with llama.cpp's
  converter when one is configured, and the reason is said when it is not.
- LM Studio and the rest: no API loads an adapter; the result is the exact manual step.

Only the adapter goes out, never a rating. Targets must be on this machine unless the config allows
otherwise. A failed push never blocks promotion: each result is kept for `status`, with the retry
command.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

from rlfleet.shared.config import Config, PushTarget
from rlfleet.shared.registry import ADAPTER_FILES

VLLM_NAME = "rlfleet"
OLLAMA_NO_ADAPTERS = (0, 34, 1)  # the first Ollama that refuses LoRA adapters
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class PushError(Exception):
    """One line: why the push did not happen, and what to do."""


@dataclass(frozen=True)
class PushResult:
    target: str
    kind: str
    version: str | None
    ok: bool | None  # None: nothing to push automatically (manual step)
    message: str
    at: float

    def as_dict(self) -> dict:
        return asdict(self)


def retry_command(target: str) -> str:
    return f"rlfleet push --target {target}"


# ---- HTTP (urllib: no event loop in a worker job) ------------------------------------------------


def _request(t: PushTarget, method: str, path: str, body: bytes | dict | None = None,
             headers: dict | None = None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    hdrs = {"Content-Type": "application/json"} if isinstance(body, dict) else {}
    if t.api_key_env and os.environ.get(t.api_key_env):
        hdrs["Authorization"] = f"Bearer {os.environ[t.api_key_env]}"
    hdrs.update(headers or {})
    assert t.url is not None  # push_one checked it (check_url)
    req = urllib.request.Request(t.url.rstrip("/") + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=t.timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise PushError(f"cannot reach {t.kind} at {t.url} ({reason})") from None


def _error_text(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:200]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message", err)
    return str(err or data.get("message", ""))[:200]


def check_url(t: PushTarget, allow_remote: bool) -> None:
    if not t.url:
        raise PushError(f"push target {t.name} has no url")
    host = urlparse(t.url).hostname
    if host not in LOOPBACK and not allow_remote:
        raise PushError(f"refusing to push to {t.url}: not this machine; set allow_remote_push = true "
                        "in config.toml if you mean it")


def _take_down(t: PushTarget, method: str, path: str, body: dict, refused: str) -> None:
    """Unload or delete what an earlier push put there; nothing there (404) is done too."""
    status, raw = _request(t, method, path, body)
    if status not in (200, 404):
        raise PushError(f"{refused}: {status} {_error_text(raw)}")


# ---- vLLM -------------------------------------------------------------------------------------------


def push_vllm(t: PushTarget, version: str | None, adapter_dir: Path | None, adapters_root: Path,
              scope: str | None = None) -> str:
    """The served version to vLLM as one LoRA name: ``rlfleet`` (or the target's ``model``) for the
    shared adapter, ``<that>-<scope key>`` for a scope's own (shared/scopes.py), side by side."""
    name = t.model or VLLM_NAME
    if scope is not None:
        name = f"{name}-{scope}"
    if version is None:
        _take_down(t, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, f"vLLM refused to unload {name}")
        return f"unloaded {name} from vLLM: clients get the base model by its own name"
    assert adapter_dir is not None  # a served version has its folder
    path = str(adapter_dir)
    if t.adapter_root:  # the server sees our adapters folder somewhere else (a container mount)
        path = str(Path(t.adapter_root) / adapter_dir.relative_to(adapters_root))
    body = {"lora_name": name, "lora_path": path, "load_inplace": True}
    status, raw = _request(t, "POST", "/v1/load_lora_adapter", body)
    if status == 400 and "already been loaded" in _error_text(raw):  # a server without load_inplace
        _request(t, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
        status, raw = _request(t, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    if status == 404 and b"No adapter found" in raw:
        raise PushError(f"vLLM cannot read {path}: set adapter_root to where that server sees {adapters_root}")
    if status == 404:
        raise PushError("vLLM has no adapter endpoints: start it with --enable-lora and "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
    if status != 200:
        raise PushError(f"vLLM refused {version}: {status} {_error_text(raw)}")
    return f"vLLM serves {version} as model {name!r}"


# ---- Ollama -----------------------------------------------------------------------------------------


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("-")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return f"sha256:{h.hexdigest()}"


def _upload(t: PushTarget, path: Path) -> str:
    digest = _digest(path)
    status, _ = _request(t, "HEAD", f"/api/blobs/{digest}")
    if status != 200:
        status, raw = _request(t, "POST", f"/api/blobs/{digest}", path.read_bytes(),
                               {"Content-Type": "application/octet-stream"})
        if status not in (200, 201):
            raise PushError(f"Ollama refused the upload of {path.name}: {status} {_error_text(raw)}")
    return digest


def _create(t: PushTarget, body: dict) -> None:
    status, raw = _request(t, "POST", "/api/create", {**body, "stream": False})
    text = raw.decode(errors="replace").strip().splitlines()
    last = json.loads(text[-1]) if text else {}
    if status != 200 or "error" in last:
        raise PushError(f"Ollama could not create {body['model']}: {status} {_error_text(raw)}")


def _converter(t: PushTarget, script: str) -> Path:
    if t.llama_cpp is None:
        raise PushError(
            "this Ollama (0.34.1 or later) no longer accepts LoRA adapters: set llama_cpp = \"/path/to/llama.cpp\" "
            f"on push target {t.name} to push a merged GGUF, or `rlfleet export merged DIR` and import it")
    path = Path(t.llama_cpp).expanduser() / script
    if not path.is_file():
        raise PushError(f"no {script} in {t.llama_cpp}: point llama_cpp at a llama.cpp checkout")
    return path


def _convert(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PushError(f"llama.cpp's converter failed: {tail[0][:200]}")


def push_ollama(t: PushTarget, cfg: Config, version: str | None, adapter_dir: Path | None) -> str:
    if not t.base:
        raise PushError(f"push target {t.name} needs base = the base model's name in Ollama (e.g. smollm2:135m)")
    name = t.model or f"{t.base}-rlfleet"
    if version is None:
        _take_down(t, "DELETE", "/api/delete", {"model": name}, f"Ollama refused to delete {name}")
        return f"removed {name} from Ollama ({t.base} itself is untouched)"
    assert adapter_dir is not None  # a served version has its folder
    status, raw = _request(t, "GET", "/api/version")
    server = _version_tuple(json.loads(raw).get("version", "")) if status == 200 else ()
    if server and server < OLLAMA_NO_ADAPTERS:
        files = {f: _upload(t, adapter_dir / f) for f in ADAPTER_FILES}
        _create(t, {"model": name, "from": t.base, "adapters": files})
        return f"Ollama serves {version} as {name} (adapter on {t.base})"
    script = _converter(t, "convert_hf_to_gguf.py")
    from rlfleet.shared.export import export_merged

    with tempfile.TemporaryDirectory(prefix="rlfleet-ollama-") as tmp:
        merged, _ = export_merged(cfg, Path(tmp) / "merged", version)
        gguf = Path(tmp) / f"{name.replace(':', '-')}.gguf"
        _convert([sys.executable, str(script), str(merged), "--outfile", str(gguf), "--outtype", "f16"])
        digest = _upload(t, gguf)
    _create(t, {"model": name, "files": {gguf.name: digest}})
    return f"Ollama serves {version} as {name} (merged GGUF)"


# ---- the rest ------------------------------------------------------------------------------------------


def manual_step(t: PushTarget, version: str | None) -> str:
    if version is None:
        return "serving the base model again: switch LM Studio back to the base model"
    return (f"no API loads an adapter there; run `rlfleet export merged ~/rlfleet-{version}`, convert it with "
            f"llama.cpp's convert_hf_to_gguf.py, then `lms import rlfleet-{version}.gguf`")


def push_one(t: PushTarget, cfg: Config, version: str | None, adapter_dir: Path | None,
             scope: str | None = None) -> PushResult:
    """``version`` (of ``scope``'s own adapter, when given: vLLM targets only) to target ``t``."""
    try:
        if t.kind in ("lmstudio", "manual"):
            return PushResult(t.name, t.kind, version, None, manual_step(t, version), time.time())
        check_url(t, cfg.allow_remote_push)
        if t.kind == "vllm":
            msg = push_vllm(t, version, adapter_dir, cfg.adapters_root, scope)
        else:
            msg = push_ollama(t, cfg, version, adapter_dir)
        return PushResult(t.name, t.kind, version, True, msg, time.time())
    except PushError as exc:
        return PushResult(t.name, t.kind, version, False, f"{exc} · retry: {retry_command(t.name)}", time.time())
    except Exception as exc:  # a push never takes the worker down; the reason goes to status
        return PushResult(t.name, t.kind, version, False,
                          f"{exc.__class__.__name__}: {str(exc)[:200]} · retry: {retry_command(t.name)}", time.time())

