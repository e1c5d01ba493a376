"""`rlfleet export adapter|merged|ratings` and `rlfleet import ratings`, as a user runs them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlfleet.cli.app import app
from rlfleet.shared.errors import BadInput
from rlfleet.shared.events import Capture, Message, Rating, Undo
from rlfleet.shared.store import Store

runner = CliRunner()


def rl(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _rated_store(url: str) -> Store:
    """Three answers: one rated good with a comment, one re-rated (good, then bad), one rated then undone."""
    store = Store(url)
    for i in range(3):
        store.apply_capture(Capture(
            capture_id=f"cap-{i}", source="slack", actor="U1", owner="U1", conversation="C1",
            message_ref=f"17000.{i}", prompt=[Message(role="user", content=f"question {i}")],
            response=f"answer {i}", model="tiny", adapter_version="v0001" if i else None,
            behaviour_logprobs=[-0.5, -0.25] if i == 0 else None, behaviour_token_ids=[5, 6] if i == 0 else None,
            finish_reason=("length", "stop", None)[i]))
    store.apply_rating(Rating(source="slack", actor="U1", target="cap-0", value=1, comment="crisp"), "tiny")
    store.apply_rating(Rating(source="slack", actor="U1", target="cap-1", value=1), "tiny")
    store.apply_rating(Rating(source="slack", actor="U1", target="cap-1", value=-1, stars=2), "tiny")
    store.apply_rating(Rating(source="slack", actor="U2", target="cap-2", value=1, scope="any"), "tiny")
    store.apply_undo(Undo(source="slack", actor="U2"))
    return store


def _rows(store: Store) -> list[tuple]:
    """Everything export promises to carry, per rating, as comparable tuples."""
    return [
        (r.event_id, r.actor, r.source, r.value, r.comment, r.stars, r.state, r.train_model, r.created, r.changed,
         c.id, c.event_id, c.source, c.conversation, c.message_ref, c.owner, c.prompt, c.response, c.model,
         c.adapter_version, c.behaviour_logprobs, c.behaviour_token_ids, c.finish_reason, c.created)
        for r, c in store.rated_pairs(all_states=True)
    ]


def _norm(rows):  # SQLite hands back naive datetimes (all UTC); PostgreSQL aware ones
    return [tuple(v.replace(tzinfo=None) if hasattr(v, "tzinfo") and v is not None else v for v in row)
            for row in rows]


def test_ratings_round_trip_to_identical_rows(home, tmp_path, db_url, monkeypatch):
    source = _rated_store(f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    out = tmp_path / "ratings.jsonl"
    res = rl("export", "ratings", out, "--all")
    assert res.exit_code == 0 and "wrote 4 ratings" in res.output, res.output
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    first = lines[0]  # TRL KTO's conversational shape
    assert first["prompt"] == [{"role": "user", "content": "question 0"}]
    assert first["completion"] == [{"role": "assistant", "content": "answer 0"}]
    assert first["label"] is True and first["comment"] == "crisp"
    assert first["rlfleet"]["behaviour_logprobs"] == [-0.5, -0.25]
    assert [x["rlfleet"].get("finish_reason") for x in lines] == ["length", "stop", "stop", None]
    assert [x["label"] for x in lines] == [True, True, False, True]
    assert [x.get("stars") for x in lines] == [None, None, 2, None]  # beside the thumb
    assert len(rl("export", "ratings", tmp_path / "active.jsonl").output.split("wrote 2 ")) == 2  # active only

    monkeypatch.setenv("DATABASE_URL", db_url)
    res = rl("import", "ratings", out, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["imported"] == 4
    assert _norm(_rows(Store(db_url))) == _norm(_rows(source))

    again = json.loads(rl("import", "ratings", out, "--json").output)  # idempotent
    assert again["imported"] == 0 and again["skipped"] == {"already imported": 4}
    assert _norm(_rows(Store(db_url))) == _norm(_rows(source))


def test_import_counts_bad_lines_and_changes_nothing_for_them(home, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    src = _rated_store(f"sqlite:///{tmp_path / 'source.db'}")
    from rlfleet.shared.ratings_io import to_example

    good = [to_example(r, c).model_dump_json() for r, c in src.rated_pairs()]
    wrong_label = json.loads(good[0])
    wrong_label["label"] = False
    clash = json.loads(good[1])
    clash["rlfleet"]["rating_event_id"] = "another-event"  # same answer, already actively rated
    bad = tmp_path / "mixed.jsonl"
    bad.write_text("\n".join([good[0], "{not json", json.dumps({"prompt": []}), json.dumps(wrong_label),
                              good[1], json.dumps(clash), ""]) + "\n")
    res = rl("import", "ratings", bad, "--json")
    report = json.loads(res.output[res.output.index("{"):])
    assert res.exit_code == 1  # some lines were refused: a script can tell
    assert report["imported"] == 2
    assert report["skipped"] == {"invalid": 3, "that answer already has an active rating here": 1}
    assert [e.split(":")[0] for e in report["errors"]] == ["line 2", "line 3", "line 4"]
    assert len(Store(f"sqlite:///{home / 'rlfleet.db'}").rated_pairs(all_states=True)) == 2
    with pytest.raises(BadInput, match="no file or folder"):
        rl("import", "ratings", tmp_path / "nope.jsonl")


def _status_ratings() -> dict:
    res = rl("status", "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)["ratings"]


def _import(path) -> dict:
    res = rl("import", "ratings", path, "--json")
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_a_backup_restores_into_the_data_dir_it_came_from(queued_home, tmp_path, db_url, monkeypatch):
    """export -> undo / reset --purge-ratings / reset -> import, as a user runs them: whatever the backup
    holds and is not here now comes back, and a second import adds nothing."""
    monkeypatch.setenv("DATABASE_URL", db_url)
    for i, word in enumerate(["good", "bad", "good"]):
        assert rl("capture", "--prompt", f"question {i}", "--response", f"answer {i}",
                  "--message-ref", f"m-{i}").exit_code == 0
        assert rl(word, "--target", f"m-{i}").exit_code == 0
    backup = tmp_path / "backup.jsonl"
    assert "wrote 3 ratings" in rl("export", "ratings", backup).output
    rows_before = _norm(_rows(Store(db_url)))

    assert rl("undo").exit_code == 0  # the last rating, taken back after the backup
    assert _status_ratings()["total"] == 2
    assert _import(backup)["imported"] == 1
    assert _status_ratings() == {"total": 3, "good": 2, "bad": 1, "pending": 3}

    assert rl("reset", "--purge-ratings", "--yes").exit_code == 0
    assert _status_ratings()["total"] == 0
    report = _import(backup)
    assert report["imported"] == 3 and report["skipped"] == {}, report
    assert _status_ratings() == {"total": 3, "good": 2, "bad": 1, "pending": 3}
    assert _norm(_rows(Store(db_url))) == rows_before

    again = _import(backup)
    assert again["imported"] == 0 and again["skipped"] == {"already imported": 3}

    assert rl("reset", "--yes").exit_code == 0  # ratings kept: nothing to restore
    assert _import(backup)["skipped"] == {"already imported": 3}
    assert _status_ratings()["total"] == 3


def test_an_answer_rated_again_after_the_backup_keeps_its_new_rating(home, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    store = _rated_store(f"sqlite:///{home / 'rlfleet.db'}")
    backup = tmp_path / "backup.jsonl"
    assert "wrote 2 ratings" in rl("export", "ratings", backup).output
    store.apply_rating(Rating(source="slack", actor="U1", target="cap-0", value=-1), "tiny")  # was good
    assert _import(backup)["skipped"] == {"already imported": 1,
                                          "that answer was rated again here since the export": 1}
    active = {c.id: r.value for r, c in store.rated_pairs()}
    assert active == {"cap-0": -1, "cap-1": -1}


def test_a_rating_whose_training_was_taken_back_trains_again_when_restored(home, tmp_path, monkeypatch):
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    store = _rated_store(f"sqlite:///{home / 'rlfleet.db'}")
    backup = tmp_path / "backup.jsonl"
    rl("export", "ratings", backup)
    pending = store.pending_ratings("tiny", 10)
    first = store.create_run("tiny")
    store.finish_run(first, model="tiny", version="v0001", parent=None, metrics={},
                     advantages={r.id: 1.0 for r, _ in pending}, retracted=[], new_ema=0.0, promote=True)
    store.apply_undo(Undo(source="slack", actor="U1", target="cap-0"))
    second = store.create_run("tiny")  # trains the retraction of cap-0's rating
    store.finish_run(second, model="tiny", version="v0002", parent="v0001", metrics={}, advantages={},
                     retracted=[r.id for r, _ in store.pending_ratings("tiny", 10)], new_ema=0.0, promote=True)
    assert store.pending_count("tiny") == 0
    assert _import(backup)["imported"] == 1
    assert [c.id for _, c in store.pending_ratings("tiny", 10)] == ["cap-0"]


def test_import_into_a_postgresql_database_restored_from_a_dump(home, tmp_path, pg_admin_url, monkeypatch):
    """The dump was taken after a purge: its processed-events table still names every purged rating."""
    import shutil
    import subprocess
    import uuid

    import sqlalchemy as sa

    if not (shutil.which("pg_dump") and shutil.which("pg_restore")):
        pytest.skip("pg_dump / pg_restore are not installed")
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    admin = sa.create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    names = [f"rlfleet_t_{uuid.uuid4().hex[:10]}" for _ in range(2)]
    urls = [pg_admin_url.rsplit("/", 1)[0] + f"/{n}" for n in names]
    with admin.connect() as c:
        for n in names:
            c.execute(sa.text(f'CREATE DATABASE "{n}"'))
    try:
        store = _rated_store(urls[0])
        monkeypatch.setenv("DATABASE_URL", urls[0])
        backup = tmp_path / "backup.jsonl"
        assert "wrote 2 ratings" in rl("export", "ratings", backup).output
        store.reset("tiny", purge_ratings=True)
        plain = [u.replace("postgresql+psycopg://", "postgresql://") for u in urls]
        dump = subprocess.run(["pg_dump", "-Fc", plain[0]], capture_output=True, check=True, timeout=60).stdout
        subprocess.run(["pg_restore", "--no-owner", "-d", plain[1]], input=dump, check=True, timeout=60)
        monkeypatch.setenv("DATABASE_URL", urls[1])
        assert _import(backup)["imported"] == 2
        assert len(Store(urls[1]).rated_pairs()) == 2
        assert _import(backup)["skipped"] == {"already imported": 2}
    finally:
        from rlfleet.shared import store as store_mod

        for u in urls:
            store_mod.forget(u)
        with admin.connect() as c:
            for n in names:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{n}" WITH (FORCE)'))
        admin.dispose()


def test_ratings_as_a_datasets_folder(home, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    _rated_store(f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    res = rl("export", "ratings", tmp_path / "ds", "--format", "datasets")
    assert res.exit_code == 0, res.output
    ds = datasets.load_from_disk(str(tmp_path / "ds"))
    assert ds.num_rows == 2 and {"prompt", "completion", "label", "rlfleet"} <= set(ds.column_names)
    from trl.data_utils import is_conversational

    assert is_conversational(ds[0])
    # the folder comes back in as the JSONL does: every field, and a second import adds nothing
    res = rl("export", "ratings", tmp_path / "all", "--format", "datasets", "--all")
    assert res.exit_code == 0, res.output
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'restored.db'}")
    assert _import(tmp_path / "all")["imported"] == 4
    assert _norm(_rows(Store(f"sqlite:///{tmp_path / 'restored.db'}"))) == \
        _norm(_rows(Store(f"sqlite:///{tmp_path / 'source.db'}")))
    assert _import(tmp_path / "all")["skipped"] == {"already imported": 4}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a dataset")
    with pytest.raises(BadInput, match="is not a folder `rlfleet export ratings --format datasets` wrote"):
        rl("import", "ratings", tmp_path / "other")


@pytest.fixture
def served_adapter(home, tiny_model_dir, monkeypatch):
    """The tiny model with a non-identity adapter v0001 being served, as training leaves it."""
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlfleet.shared.models import resolve_model
    from rlfleet.shared.registry import AdapterRegistry

    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    registry = AdapterRegistry(home / "adapters", resolve_model(str(tiny_model_dir)).slug)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(registry.path("v0001"))
    (registry.path("v0001") / "meta.json").write_text('{"parent": null}')
    registry.set_current("v0001")
    return registry


def _logprobs(model, ids):
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(-1)


def test_adapter_and_merged_exports_load_and_agree(served_adapter, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = rl("export", "adapter", tmp_path / "adapter")
    assert res.exit_code == 0 and "wrote adapter v0001" in res.output, res.output
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "meta.json"}
    res = rl("export", "merged", tmp_path / "merged")
    assert res.exit_code == 0, res.output
    assert list((tmp_path / "merged").glob("*.safetensors")) and not list(tmp_path.glob(".*partial"))

    ids = AutoTokenizer.from_pretrained(tmp_path / "merged")("The ratings improve the model.")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    expected = _logprobs(with_adapter, ids)
    assert (_logprobs(merged, ids) - expected).abs().max().item() < 1e-4
    with with_adapter.disable_adapter():
        assert (_logprobs(with_adapter, ids) - expected).abs().max().item() > 1e-3  # the adapter matters


def test_export_refuses_what_it_cannot_do(served_adapter, tmp_path):
    from rlfleet.shared.errors import NotFound

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(BadInput, match="not an empty folder"):
        rl("export", "adapter", tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    with pytest.raises(NotFound, match="no adapter version v0009"):
        rl("export", "merged", tmp_path / "m", "--version", "v0009")
    res = rl("export", "adapter", tmp_path / "typed", "--version", "1")  # a version as people type it
    assert res.exit_code == 0 and "wrote adapter v0001" in res.output, res.output
    served_adapter.set_current(None)
    with pytest.raises(NotFound, match="no adapter is being served"):
        rl("export", "adapter", tmp_path / "a")


def _listing(root) -> set:
    return {(str(p.relative_to(root)), p.is_dir() or p.read_bytes()) for p in root.rglob("*")}


@pytest.mark.parametrize("dest, extra, why", [
    ("a-file/sub.jsonl", [], "a-file is a file, not a folder"),
    ("", [], "the destination is empty"),
    (".", [], "'.' is not a file name"),
    ("a-folder", [], "a-folder is a folder: give a file name"),
    ("a-file", [], "a-file exists: pass --force to overwrite it"),
    ("a-file", ["--format", "datasets"], "a-file is a file, and this export writes a folder"),
    ("/dev/null", ["--force"], "/dev/null exists and is not a regular file"),
])
def test_export_ratings_refuses_a_place_it_cannot_write_on_one_line_and_writes_nothing(
        home, tmp_path, monkeypatch, dest, extra, why):
    _rated_store(f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    work = tmp_path / "work"
    work.mkdir()
    (work / "a-file").write_text("mine")
    (work / "a-folder").mkdir()
    monkeypatch.chdir(work)
    before = _listing(work)
    with pytest.raises(BadInput, match=why):
        rl("export", "ratings", dest, *extra)
    assert _listing(work) == before  # no stray .tmp beside a folder, the file untouched


def test_export_ratings_makes_missing_folders_and_overwrites_a_file_only_with_force(home, tmp_path, monkeypatch):
    _rated_store(f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("DATABASE_URL", f"sqlite:///{tmp_path / 'source.db'}")
    monkeypatch.setenv("RLFLEET_MODEL", "tiny")
    out = tmp_path / "new" / "deeper" / "ratings.jsonl"
    res = rl("export", "ratings", out)
    assert res.exit_code == 0 and f"wrote 2 ratings to {out}" in res.output, res.output
    out.write_text("old\n")
    res = rl("export", "ratings", out, "--force")
    assert res.exit_code == 0, res.output
    assert len(out.read_text().splitlines()) == 2 and [p.name for p in out.parent.iterdir()] == ["ratings.jsonl"]


def test_a_failed_ratings_write_leaves_nothing_behind(tmp_path):
    from rlfleet.shared.ratings_io import write_jsonl

    def examples():
        raise OSError(28, "No space left on device")
        yield

    with pytest.raises(BadInput, match="cannot write .*No space left on device"):
        write_jsonl(examples(), tmp_path / "new" / "ratings.jsonl")
    assert list(tmp_path.iterdir()) == []  # neither the staging file nor the folder made for it


def test_adapter_and_merged_exports_refuse_a_place_they_cannot_write_before_loading_anything(
        served_adapter, tmp_path, monkeypatch):
    import rlfleet.shared.export as export

    def no_loading(*a, **k):
        raise AssertionError("loaded the model before checking where it goes")

    monkeypatch.setattr(export, "load_model", no_loading)
    (tmp_path / "a-file").write_text("mine")
    before = _listing(tmp_path)
    for kind in ("adapter", "merged"):
        with pytest.raises(BadInput, match="a-file is a file, not a folder"):
            rl("export", kind, tmp_path / "a-file" / "sub")
        with pytest.raises(BadInput, match="a-file is a file, and this export writes a folder"):
            rl("export", kind, tmp_path / "a-file")
        with pytest.raises(BadInput, match="the destination is empty"):
            rl("export", kind, "")
    with pytest.raises(BadInput, match="cannot write /proc/x"):
        rl("export", "adapter", "/proc/x")
    assert _listing(tmp_path) == before
