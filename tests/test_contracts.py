"""The contracts between processes hold: job names resolve to the worker's jobs, a job's answer keeps
its wire form, the status object has the documented shape wherever it is read, and only the registry
spells the adapter folder's format."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from rq.utils import import_attribute

from rlfleet.shared import job_names
from rlfleet.shared.config import load_config
from rlfleet.shared.job_result import JobResult
from rlfleet.shared.models import model_slug
from rlfleet.shared.queue import status_key
from rlfleet.shared.registry import (
    ADAPTER_FILES,
    CURRENT_FILE,
    AdapterRegistry,
    Pointer,
    read_pointer,
    version_name,
)
from rlfleet.shared.status import build_status, gather_status, publish_snapshot
from rlfleet.shared.store import Store

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", job_names.ALL)
def test_every_job_name_is_a_function_of_the_worker_jobs_module(name):
    assert name.startswith("rlfleet.worker.jobs.")  # jobs already queued in users' Redis name these paths
    assert callable(import_attribute(name))


def test_a_job_result_keeps_its_wire_form():
    wire = {"ok": True, "message": "rated good", "duplicate": False, "capture_id": "c1", "training": None}
    result = JobResult.from_dict(wire)
    assert result.ok and result.message == "rated good" and result.extra["capture_id"] == "c1"
    assert list(result.to_dict().items()) == list(wire.items())
    assert JobResult.failed("no").to_dict() == {"ok": False, "message": "no"}
    more = JobResult.done("now serving v0002", version="v0002").with_extra(training="queued")
    assert more.to_dict() == {"ok": True, "message": "now serving v0002", "version": "v0002", "training": "queued"}


STATUS_KEYS = ["model", "model_slug", "ratings", "threshold", "preset", "ema", "ema_seeded", "lineage", "adapter",
               "training", "queue", "workers", "push", "bots", "durability", "scopes"]


def test_the_status_has_the_documented_shape_and_the_snapshot_is_the_same_object(queued_home, rconn):
    cfg = load_config()
    slug = model_slug(cfg.model)
    store = Store(cfg.db_url)
    st = build_status(cfg, store, rconn, slug)
    assert list(st) == STATUS_KEYS
    assert st["ratings"] == {"total": 0, "good": 0, "bad": 0, "pending": 0}
    assert st["scopes"] == {}
    assert st["ema"] == 0.0 and st["ema_seeded"] is False
    assert st["adapter"] == {"current": None, "versions": []}
    assert st["training"] == {"state": "idle", "error": None, "run_id": None, "progress": None, "paused": False}
    assert list(st["queue"]) == ["events", "train", "dead_letters"]
    assert st["durability"] is not None
    publish_snapshot(cfg, store, rconn, slug)
    assert json.loads(rconn.get(status_key(slug))) == gather_status(cfg, store, rconn, slug).to_dict()
    offline = build_status(cfg, store, None, slug)  # no Redis: what the store alone says
    assert offline["workers"] == 0 and offline["durability"] is None and offline["push"] == []


@pytest.mark.parametrize(("content", "pointer"), [
    (None, Pointer(None)),
    ("", Pointer(None)),
    ("v0002\n", Pointer("v0002")),
    ("../v0001", "not a version name"),
    ("x" * 300, "too long"),
    (b"\xff\xfe", "not text"),
])
def test_current_is_read_one_way(tmp_path, content, pointer):
    registry = AdapterRegistry(tmp_path, "tiny")
    registry.dir.mkdir(parents=True)
    for version in ("v0001", "v0002"):
        for name in ADAPTER_FILES:
            (registry.dir / version).mkdir(exist_ok=True)
            (registry.dir / version / name).write_bytes(b"{}")
    if content is not None:
        path = registry.dir / CURRENT_FILE
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    got = read_pointer(registry.dir)
    if isinstance(pointer, Pointer):
        assert got == pointer
    else:
        assert got.name is None and pointer in got.problem
    assert registry.current() == got.name  # the registry serves what the pointer names, and nothing else


def _literals(path: Path) -> list[tuple[int, str]]:
    """The string constants in a module's code, docstrings left out."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def _spelled_outside(owner: str, needles: tuple[str, ...]) -> list[str]:
    found = []
    for folder in ("shared", "bots", "bridge", "worker"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == owner:
                continue
            found += [f"{path.relative_to(ROOT)}:{line}: {text!r}" for line, text in _literals(path)
                      if any(needle in text for needle in needles)]
    return found


@pytest.mark.parametrize("typed, name", [
    ("v0003", "v0003"), ("v3", "v0003"), ("3", "v0003"), (" V03 ", "v0003"), ("v12345", "v12345"),
    ("base", "base"), ("v3x", "v3x"), ("-1", "-1"), ("3.0", "3.0"), ("", ""),
])
def test_a_version_as_people_type_it_is_the_registrys_name(typed, name):
    assert version_name(typed) == name


def test_only_the_registry_spells_the_adapter_folder_format():
    needles = ("adapter_config.json", "adapter_model.", "meta.json")
    assert _spelled_outside("shared/registry.py", needles) == []
    pointer = [hit for hit in _spelled_outside("shared/registry.py", ("CURRENT",)) if hit.endswith("'CURRENT'")]
    assert pointer == []


def test_only_job_names_spells_the_job_paths():
    assert _spelled_outside("shared/job_names.py", ("rlfleet.worker.jobs.",)) == []
