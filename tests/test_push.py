"""Pushing the served adapter to vLLM and Ollama: the documented request shapes against recording fakes on
127.0.0.1, the fallbacks, the refusals, and a failed push that never blocks promotion."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from botfakes import FakeOllama, FakeVLLM, in_thread
from rq import Queue, SimpleWorker

from rlfleet.shared.config import PushTarget, load_config
from rlfleet.shared.events import Command
from rlfleet.shared.queue import EVENTS_QUEUE, enqueue_event, open_queue
from rlfleet.shared.registry import AdapterRegistry
from rlfleet.shared.status import push_results
from rlfleet.worker.push_schedule import run_push


def _adapter(folder: Path, seed: int) -> None:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 4, "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    (folder / "meta.json").write_text("{}")


@pytest.fixture
def setup(queued_home, rconn):
    cfg = load_config(model="tiny")
    registry = AdapterRegistry(cfg.adapters_root, "tiny")
    for i in (1, 2):
        _adapter(registry.path(f"v000{i}"), i)
    return cfg, registry, rconn


def _push(cfg, registry, conn, *targets: PushTarget, only=None) -> dict:
    cfg.push = list(targets)
    return run_push(cfg, registry, conn, only).to_dict()


def test_vllm_gets_each_version_under_one_name_in_place(setup):
    cfg, registry, conn = setup
    with in_thread(FakeVLLM()) as vllm:
        target = PushTarget(name="gpu", kind="vllm", url=vllm.url)
        registry.set_current("v0001")
        assert _push(cfg, registry, conn, target)["ok"]
        registry.set_current("v0002")
        result = _push(cfg, registry, conn, target)
        assert result["ok"] and "serves v0002 as model 'rlfleet'" in result["message"]
        assert vllm.of("/v1/load_lora_adapter")[-1] == {
            "lora_name": "rlfleet", "lora_path": str(registry.path("v0002")), "load_inplace": True}
        assert vllm.loaded == {"rlfleet": str(registry.path("v0002"))}
        registry.set_current(None)  # back to the base: the name goes away
        assert _push(cfg, registry, conn, target)["ok"] and vllm.loaded == {}
        assert vllm.of("/v1/unload_lora_adapter") == [{"lora_name": "rlfleet"}]


def test_vllm_without_load_inplace_is_unloaded_then_loaded_with_its_key_and_mount(setup, monkeypatch, tmp_path):
    cfg, registry, conn = setup
    monkeypatch.setenv("VLLM_KEY", "k-123")
    mount = tmp_path / "mnt"
    (mount / "tiny").mkdir(parents=True)
    for v in ("v0001", "v0002"):
        _adapter(mount / "tiny" / v, 9)  # the same adapters as the vLLM container sees them
    with in_thread(FakeVLLM(inplace=False, api_key="k-123")) as vllm:
        target = PushTarget(name="box", kind="vllm", url=vllm.url, model="team", api_key_env="VLLM_KEY",
                            adapter_root=str(mount))
        for v in ("v0001", "v0002"):
            registry.set_current(v)
            assert _push(cfg, registry, conn, target)["ok"]
        assert vllm.loaded == {"team": str(mount / "tiny" / "v0002")}
        assert [c.path for c in vllm.calls] == ["/v1/load_lora_adapter", "/v1/load_lora_adapter",
                                                "/v1/unload_lora_adapter", "/v1/load_lora_adapter"]
        monkeypatch.setenv("VLLM_KEY", "wrong")
        result = _push(cfg, registry, conn, target)
        assert not result["ok"] and "401" in result["message"]


def test_failures_say_why_and_how_to_retry_and_status_shows_them(setup):
    cfg, registry, conn = setup
    registry.set_current("v0001")
    targets = [PushTarget(name="down", kind="vllm", url="http://127.0.0.1:9"),
               PushTarget(name="far", kind="vllm", url="http://10.1.2.3:8000"),
               PushTarget(name="studio", kind="lmstudio")]
    result = _push(cfg, registry, conn, *targets)
    assert not result["ok"]
    by = {r["target"]: r for r in result["results"]}
    assert by["down"]["ok"] is False and "cannot reach vllm" in by["down"]["message"]
    assert "retry: rlfleet push --target down" in by["down"]["message"]
    assert by["far"]["ok"] is False and "refusing to push to http://10.1.2.3:8000" in by["far"]["message"]
    assert by["studio"]["ok"] is None and "lms import" in by["studio"]["message"]
    assert [p["target"] for p in push_results(conn, "tiny")] == ["down", "far", "studio"]


def test_ollama_before_0_34_gets_the_adapter_on_its_base(setup):
    cfg, registry, conn = setup
    registry.set_current("v0002")
    with in_thread(FakeOllama(version="0.33.0")) as ollama:
        target = PushTarget(name="ollama", kind="ollama", url=ollama.url, base="smollm2:135m")
        result = _push(cfg, registry, conn, target)
        assert result["ok"], result["message"]
        digests = {f: "sha256:" + hashlib.sha256((registry.path("v0002") / f).read_bytes()).hexdigest()
                   for f in ("adapter_config.json", "adapter_model.safetensors")}
        assert ollama.of("/api/create") == [{"model": "smollm2:135m-rlfleet", "from": "smollm2:135m",
                                             "adapters": digests, "stream": False}]
        assert set(ollama.blobs) == set(digests.values())
        n = len(ollama.calls)
        assert _push(cfg, registry, conn, target)["ok"]  # blobs already there: only HEADs, no uploads
        assert not [c for c in ollama.calls[n:] if c.body.get("bytes")]
        assert "smollm2:135m" not in ollama.models  # the base is never touched
        registry.set_current(None)
        assert _push(cfg, registry, conn, target)["ok"] and ollama.models == {}


def test_ollama_0_34_refuses_adapters_so_a_merged_gguf_goes_when_llama_cpp_is_there(setup, tiny_model_dir, tmp_path):
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg, _, conn = setup
    cfg.model = str(tiny_model_dir)
    from rlfleet.shared.models import resolve_model

    registry = AdapterRegistry(cfg.adapters_root, resolve_model(cfg.model).slug)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, lora_alpha=4, target_modules="all-linear")).save_pretrained(
        registry.path("v0001"))
    registry.set_current("v0001")
    with in_thread(FakeOllama(version="0.34.2")) as ollama:
        target = PushTarget(name="ollama", kind="ollama", url=ollama.url, base="tiny")
        result = _push(cfg, registry, conn, target)
        assert not result["ok"] and "no longer accepts LoRA adapters" in result["message"]
        assert "llama_cpp" in result["message"] and not ollama.of("/api/create")

        llama = tmp_path / "llama.cpp"  # llama.cpp's converter, as far as rlfleet can tell: its CLI
        llama.mkdir()
        (llama / "convert_hf_to_gguf.py").write_text(
            "import sys, pathlib\nargs = sys.argv[1:]\n"
            "src, out = pathlib.Path(args[0]), args[args.index('--outfile') + 1]\n"
            "assert (src / 'config.json').is_file() and list(src.glob('*.safetensors')), src\n"
            "pathlib.Path(out).write_bytes(b'GGUF' + ' '.join(args[2:]).encode())\n")
        target = PushTarget(name="ollama", kind="ollama", url=ollama.url, base="tiny", llama_cpp=llama)
        result = _push(cfg, registry, conn, target)
        assert result["ok"], result["message"]
        (create,) = ollama.of("/api/create")
        assert create["model"] == "tiny-rlfleet" and list(create["files"]) == ["tiny-rlfleet.gguf"]
        gguf = ollama.blobs[create["files"]["tiny-rlfleet.gguf"]]
        assert gguf.startswith(b"GGUF") and gguf.endswith(b"tiny-rlfleet.gguf --outtype f16")


def test_promotion_through_the_worker_pushes_and_a_dead_server_does_not_block_it(setup):
    cfg, registry, conn = setup
    registry.set_current("v0001")
    cfg.push = [PushTarget(name="gpu", kind="vllm", url="http://127.0.0.1:9")]
    cfg.save()
    handle = open_queue(cfg)
    try:
        job = enqueue_event(handle, Command(name="rollback", args={"version": "base"}))
        SimpleWorker([Queue(EVENTS_QUEUE, connection=handle.redis)], connection=handle.redis).work(burst=True)
        assert job.result()["ok"]  # served the base although the push failed
        assert registry.current() is None
        (pushed,) = push_results(handle.redis, "tiny")
        assert pushed["ok"] is False and pushed["version"] is None and "retry: rlfleet push" in pushed["message"]
    finally:
        handle.close()



def test_rlfleet_push_is_the_retry(setup):
    from typer.testing import CliRunner

    from rlfleet.cli.app import app
    from rlfleet.shared.errors import BadInput

    cfg, registry, conn = setup
    registry.set_current("v0002")
    with pytest.raises(BadInput, match=r"no push targets: add a \[\[push\]\] section"):
        CliRunner().invoke(app, ["push"], catch_exceptions=False)
    with in_thread(FakeVLLM()) as vllm:
        cfg.push = [PushTarget(name="gpu", kind="vllm", url=vllm.url)]
        cfg.save()
        res = CliRunner().invoke(app, ["push", "--target", "gpu"], catch_exceptions=False)
        assert res.exit_code == 0 and "gpu: ok vLLM serves v0002" in res.output
        assert vllm.loaded == {"rlfleet": str(registry.path("v0002"))}
    res = CliRunner().invoke(app, ["push"], catch_exceptions=False)  # the server is gone now
    assert res.exit_code == 2 and "failed" in res.output
    with pytest.raises(BadInput, match="no push target 'nope'"):
        CliRunner().invoke(app, ["push", "--target", "nope"], catch_exceptions=False)


def test_a_scopes_version_goes_to_vllm_under_a_name_of_its_own(setup):
    from rlfleet.shared import scopes

    cfg, registry, conn = setup
    alice = AdapterRegistry(cfg.adapters_root, scopes.lineage("tiny", "person:slack:U1"))
    _adapter(alice.path("v0001"), 5)
    with in_thread(FakeVLLM()) as vllm:
        targets = [PushTarget(name="gpu", kind="vllm", url=vllm.url), PushTarget(name="by-hand", kind="manual")]
        registry.set_current("v0001")
        assert _push(cfg, registry, conn, *targets)["ok"]
        alice.set_current("v0001")
        result = _push(cfg, alice, conn, *targets)
        assert result["ok"] and [r["target"] for r in result["results"]] == ["gpu"]  # one LoRA per name: vLLM only
        assert vllm.loaded == {"rlfleet": str(registry.path("v0001")),
                               "rlfleet-person:slack:U1": str(alice.path("v0001"))}  # side by side
        alice.set_current(None)  # her rollback to the base: her name goes, the shared one stays
        assert _push(cfg, alice, conn, *targets)["ok"] and list(vllm.loaded) == ["rlfleet"]
