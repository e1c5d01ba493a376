"""Micro-batches on threads of their own (worker/training/parallel.py): the same run, the same gradient
in the same order, errors that stop the pass, and the LoRA layers' casts restored after a bf16 pass."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from rlfleet.shared.config import TrainSettings
from rlfleet.worker.batching import encode_sample
from rlfleet.worker.presets import preset
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training.parallel import MicroBatchPool, auto_workers


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


TOPICS = ["cats", "rain", "tea", "maps", "jazz", "bread", "snow", "chess", "kites", "owls"]
SAMPLES = [TrainSample(i, chat(f"Tell me about {t}."), "yes yes yes yes" if i % 2 else "no no no no",
                       1.0 if i % 2 else -1.0) for i, t in enumerate(TOPICS)]
# Small micro-batches, so that a pass has several of them; explored answers and loop checks off: the
# run's own parts only.
CFG = replace(preset("balanced"), lr=3e-3, steps=3, micro_batch_tokens=64, seq_band=(0.5, 2.0), explore=0,
              unlikelihood=0.0, precision="fp32")


@pytest.fixture
def trainer(tiny_trainer):
    yield tiny_trainer
    tiny_trainer.parallel_batches(None)


def adapter_weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def test_auto_runs_two_at_once_on_a_bf16_cpu_with_two_threads_and_the_memory_and_one_elsewhere():
    gib = 2**30
    assert auto_workers("cpu", 2, 8 * gib, gib // 2, "bf16") == 2
    assert auto_workers("cpu", 16, 64 * gib, 8 * gib, "bf16") == 2
    assert auto_workers("cpu", 1, 8 * gib, gib // 2, "bf16") == 1  # one thread: nothing to share out
    assert auto_workers("cuda", 16, 64 * gib, gib, "bf16") == 1 and auto_workers("mps", 8, 64 * gib, gib, "bf16") == 1
    assert auto_workers("cpu", 2, 3 * gib, gib // 2, "bf16") == 1  # under 4 GiB available
    assert auto_workers("cpu", 16, 12 * gib, 8 * gib, "bf16") == 1  # under twice the model's weights
    assert auto_workers("cpu", 16, 64 * gib, gib // 2, "fp32") == 1  # fp32: four times the memory for little
    assert TrainSettings().parallel_batches is None
    assert TrainSettings(parallel_batches=3).parallel_batches == 3
    with pytest.raises(ValueError):
        TrainSettings(parallel_batches=0)


@pytest.mark.parametrize(("precision", "unlikelihood"), [("fp32", 0.0), ("bf16", 0.0), ("fp32", 1.0)])
def test_a_run_with_micro_batches_side_by_side_is_the_same_run(trainer, tmp_path, monkeypatch, precision,
                                                               unlikelihood):
    # With the loop checks on, the caught loops' micro-batches run in the same pool as the step's own.
    cfg = replace(CFG, precision=precision, unlikelihood=unlikelihood)
    seen = []
    each = type(trainer).each

    def counted(self, fn, items):
        out = each(self, fn, items)
        seen.append((len(items), self._pool.workers))
        return out

    monkeypatch.setattr(type(trainer), "each", counted)
    if unlikelihood:  # the policy's answers as the loop checks see them: looping ones, each its own way
        monkeypatch.setattr(type(trainer), "sample", lambda self, rows, n, seed, *a, **k: [
            [10 + (seed + i) % 7, 20, 30] * 4 for i in range(len(rows))])
    trainer.parallel_batches(1)
    one = trainer.run(SAMPLES, None, cfg, None, tmp_path / "one").metrics
    trainer.parallel_batches(2)
    seen.clear()
    two = trainer.run(SAMPLES, None, cfg, None, tmp_path / "two").metrics
    # The passes did run two at a time: the reference pass and every step over several micro-batches.
    assert seen and all(workers == 2 for _, workers in seen) and max(n for n, _ in seen) >= 3
    assert two["loss"] == one["loss"] and two["final_mean_kl"] == one["final_mean_kl"] and two["loss"] != 0
    if unlikelihood:
        assert one["loop_answers"] > 0 and two["loop_answers"] == one["loop_answers"], two  # it caught loops
    wa, wb = adapter_weights(tmp_path / "one"), adapter_weights(tmp_path / "two")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(float(w.abs().max()) > 0 for k, w in wb.items() if "lora_B" in k)  # it trained
    # bf16 turns the LoRA layers' input casts off while a pass runs; the last pass out turns them back on.
    with trainer.adapter(None, cfg, trainable=True, precision=precision):
        enc = [encode_sample(trainer.tokenizer, s, 1024) for s in SAMPLES]
        _, batches = trainer.batches(enc, 64)
        trainer.each(trainer.logprobs, batches)
        assert all(layer.cast_input_dtype_enabled for layer in trainer._lora)


def test_results_and_gradients_come_in_the_items_order():
    # Float addition is not associative: the order the gradients are added in shows in the sum.
    p = torch.zeros(1, requires_grad=True)
    values = [1.0, 1e8, -1e8]
    pool = MicroBatchPool(3)

    def work(k: int) -> int:
        time.sleep(0.2 * (len(values) - k))  # the first item finishes last
        pool.backward((p * values[k]).sum(), [p])
        return k

    try:
        assert pool.map(work, range(3), [p]) == [0, 1, 2]
    finally:
        pool.close()
    serial = torch.zeros(1, requires_grad=True)
    for v in values:
        (serial * v).sum().backward()
    assert torch.equal(p.grad, serial.grad) and float(p.grad) == 0.0  # (1 + 1e8) - 1e8 in fp32
    # Taken as they finish, the same gradients would sum to 1.
    assert float(torch.tensor(-1e8) + torch.tensor(1e8) + torch.tensor(1.0)) == 1.0


def test_a_micro_batch_that_fails_stops_the_pass_and_nothing_runs_after_it():
    running = threading.Event()
    finished: list[int] = []
    pool = MicroBatchPool(2)

    def work(k: int) -> int:
        if k == 0:
            running.wait(5)
            raise ValueError("bad micro-batch")
        running.set()
        time.sleep(0.3)
        finished.append(k)
        return k

    try:
        with pytest.raises(ValueError, match="bad micro-batch"):
            pool.map(work, list(range(8)))
        done = list(finished)
        time.sleep(0.5)
        assert finished == done  # nothing was still running once the error reached the caller
        assert len(done) < 7  # the items not yet started were dropped
    finally:
        pool.close()


def test_one_worker_or_one_item_runs_in_the_callers_thread():
    caller = threading.get_ident()
    assert MicroBatchPool(1).map(lambda _: threading.get_ident(), [0, 1]) == [caller, caller]
    pool = MicroBatchPool(2)
    try:
        assert pool.map(lambda _: threading.get_ident(), [0]) == [caller]
        assert caller not in pool.map(lambda _: threading.get_ident(), [0, 1])
        # The caller's grad mode holds on the pool's threads (torch keeps it per thread).
        with torch.no_grad():
            assert pool.map(lambda _: torch.is_grad_enabled(), [0, 1]) == [False, False]
        assert pool.map(lambda _: torch.is_grad_enabled(), [0, 1]) == [True, True]
    finally:
        pool.close()


def test_a_session_left_to_itself_runs_two_micro_batches_at_once_in_bf16_only(trainer, monkeypatch):
    from rlfleet.worker.training import torch_backend

    monkeypatch.setattr(torch_backend, "spare_memory", lambda: 64 * 2**30)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    trainer.parallel_batches(None)
    with trainer.adapter(None, CFG, trainable=True, precision="fp32"):
        assert trainer._pool.workers == 1
    if trainer.resolved_precision("bf16") != "bf16":
        pytest.skip("this CPU trains in fp32 whatever the setting")
    with trainer.adapter(None, CFG, trainable=True, precision="bf16"):
        assert trainer._pool.workers == 2
