"""llama.cpp as the responder's token engine (shared/llamacpp_engine.py): the default model answering
through llama.cpp with the torch model's log-probs, adapters included.

The engine is right when the tokens llama.cpp draws are the ones the torch model (the trainer's view)
ranks first: greedy answers under llama.cpp score near the top of torch's distribution at every step,
with the base and with an adapter, and would not with the adapter's query/key rows left in Hugging
Face's order (the negative control)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from rlfleet.shared import lora_gguf
from rlfleet.shared.lora_gguf import LoraConversionError

PROMPTS = ["What is the capital of France?", "Name a fruit.", "Give me one tip for writing clean code.",
           "Why is the sea salty?"]


def test_engine_choice_is_checked_and_auto_says_why_it_uses_torch(tiny_model_dir, caplog):
    from rlfleet.shared.errors import ConfigError
    from rlfleet.shared.llamacpp_engine import engine_for as _engine_for
    from rlfleet.shared.models import resolve_model

    ref = resolve_model(str(tiny_model_dir))  # a Hugging Face folder, not a GGUF file
    assert _engine_for(ref, "torch", "cpu", 8) is None
    with caplog.at_level(logging.INFO, logger="rlfleet.shared.llamacpp_engine"):
        assert _engine_for(ref, "auto", "cpu", 8) is None
    assert "not a GGUF file" in caplog.text
    with pytest.raises(ConfigError, match="chat.engine is llama.cpp, but .* is not a GGUF file"):
        _engine_for(ref, "llama.cpp", "cpu", 8)
    with pytest.raises(ConfigError, match="unknown engine"):
        _engine_for(ref, "vllm", "cpu", 8)


# ---------------------------------------------------------------------------------- the default model

@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from rlfleet.shared.models import resolve_model

    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the dev extra brings it)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLFLEET_MODEL_CACHE", str(tmp_path_factory.mktemp("model-copies")))
        try:
            yield resolve_model("smollm2-135m")
        except Exception as exc:
            pytest.fail(f"default model not installed ({exc}); run the README's install command")


@pytest.fixture(scope="module")
def adapters(ref, tmp_path_factory) -> Path:
    """The adapters folder with one version: a random LoRA of the trainer's shape, strong enough to
    change the greedy answers."""
    from peft import LoraConfig, get_peft_model

    from rlfleet.shared.models import load_model
    from rlfleet.shared.registry import AdapterRegistry

    registry = AdapterRegistry(tmp_path_factory.mktemp("adapters"), ref.slug)
    torch.manual_seed(0)
    model = get_peft_model(load_model(ref), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    (registry.dir / "v0001").mkdir(parents=True)
    model.save_pretrained(str(registry.dir / "v0001"))
    return registry.dir


@pytest.fixture(scope="module")
def responder(ref, adapters):
    from rlfleet.shared.responder import LocalResponder

    r = LocalResponder(ref, adapters, device="cpu", max_new_tokens=12, temperature=0.0, engine="llama.cpp")
    assert r.engine == "llama.cpp"
    yield r
    r._engine.close()


def _gaps(model, rows) -> list[float]:
    """Per answer token of each ``(prompt ids, answer ids)``: ``model``'s top log-prob minus that of the
    token drawn (0: torch's own argmax)."""
    gaps = []
    with torch.inference_mode():
        for ids, answer in rows:
            full = torch.tensor([list(ids) + list(answer)])
            logp = torch.log_softmax(model(input_ids=full).logits[0, len(ids) - 1:-1].float(), -1)
            picked = logp.gather(-1, torch.tensor(answer).view(-1, 1)).squeeze(-1)
            gaps += (logp.max(-1).values - picked).tolist()
    return gaps


def _rank_gaps(responder, answers) -> list[float]:
    """:func:`_gaps` of the responder's answers under the state answering now."""
    rows = [(responder.tokenizer.apply_chat_template(a.messages, add_generation_prompt=True, return_dict=True,
                                                     return_tensors="pt")["input_ids"][0].tolist(), a.token_ids)
            for a in answers]
    with responder._lock:
        chosen = responder._select(None)
        with chosen.context:
            return _gaps(chosen.model, rows)


def _greedy(responder):
    return responder.answer_many([[{"role": "user", "content": p}] for p in PROMPTS], seed=0)


def _pointing(adapters: Path, version: str | None) -> None:
    pointer = adapters / "CURRENT"
    pointer.unlink(missing_ok=True)
    if version:
        pointer.write_text(version + "\n")


def test_llama_cpp_answers_are_torchs_greedy_answers_with_and_without_an_adapter(responder, adapters):
    _pointing(adapters, None)
    base = _greedy(responder)
    assert all(a.adapter_version is None and a.new_tokens > 0 for a in base)
    gaps = _rank_gaps(responder, base)
    assert max(gaps) < 0.5 and np.mean(gaps) < 0.05, gaps  # the same weights, quantised products

    _pointing(adapters, "v0001")
    tuned = _greedy(responder)
    assert all(a.adapter_version == "v0001" for a in tuned)
    assert [a.token_ids for a in tuned] != [a.token_ids for a in base]
    gaps = _rank_gaps(responder, tuned)
    assert max(gaps) < 0.5 and np.mean(gaps) < 0.05, gaps  # llama.cpp applied the adapter as peft does


def test_query_key_rows_are_permuted_as_llama_cpp_needs_and_would_not_match_otherwise(responder, adapters,
                                                                                      monkeypatch):
    """A strong adapter on the query and key projections only: its greedy answers under llama.cpp are
    torch's with the rows permuted, and leave torch's argmax without (the negative control)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from rlfleet.shared.llamacpp_engine import LlamaCppEngine

    qk = adapters / "v0003"
    shutil.copytree(adapters / "v0001", qk)
    state = load_file(str(qk / "adapter_model.safetensors"))
    state = {k: v * (6.0 if "lora_B" in k else 1.0) for k, v in state.items() if "q_proj" in k or "k_proj" in k}
    save_file(state, str(qk / "adapter_model.safetensors"))
    _pointing(adapters, "v0003")
    right = responder._engine
    try:
        good = _greedy(responder)
        good_gaps = _rank_gaps(responder, good)
        monkeypatch.setattr(lora_gguf, "PERMUTED_ARCHS", frozenset())
        wrong = LlamaCppEngine(right.gguf_path, threads=torch.get_num_threads(), max_batch=4,
                               extra_bufts=right.extra_bufts)
        responder._engine = wrong
        bad = _greedy(responder)
        wrong.close()
        responder._engine = right
        bad_gaps = _rank_gaps(responder, bad)
    finally:
        responder._engine = right
        _pointing(adapters, "v0001")
    # A near tie can flip under the served Q8_0 copy's rounding; the mean is what tells them apart.
    assert max(good_gaps) < 1.0 and np.mean(good_gaps) < 0.05, good_gaps
    assert max(bad_gaps) > 1.0 and np.mean(bad_gaps) > 0.2, bad_gaps


def test_where_llama_cpp_draws_it_records_its_own_log_probs_and_torch_runs_nothing(responder, adapters):
    """The answer's log-probs are those of the logits llama.cpp drew from (streamed or not, one turn or
    a conversation, one answer or a batch): within hundredths of a nat of torch's fp32 pass, and no torch
    forward is run to get them (docs/objective.md, "Behaviour": a run starting from the version that
    answered recomputes them in its own numerics anyway)."""
    from rlfleet.shared.responder import batch_token_logprobs

    _pointing(adapters, "v0001")
    calls = []
    with responder._lock:
        hook = responder._select(None).model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        convo = [{"role": "user", "content": PROMPTS[0]}]
        first = responder.answer(convo, seed=1, temperature=0.7, top_p=0.9)
        convo += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Spain?"}]
        pieces: list[str] = []
        second = responder.answer(convo, seed=2, on_text=pieces.append, temperature=0.7, top_p=0.9)
        many = responder.answer_many([[{"role": "user", "content": p}] for p in PROMPTS[1:3]], seed=3,
                                     temperature=0.7, top_p=0.9)
    finally:
        hook.remove()
    assert calls == []  # torch ran nothing
    assert "".join(pieces).strip() == second.text
    gaps = []
    with responder._lock:
        chosen = responder._select(None)
        for a in (first, second, *many):
            ids = responder.tokenizer.apply_chat_template(a.messages, add_generation_prompt=True, return_dict=True,
                                                          return_tensors="pt")["input_ids"][0].tolist()
            assert len(a.logprobs) == len(a.token_ids) == a.new_tokens > 0
            own: list[list[float]] = []
            seed = {id(first): 1, id(second): 2}.get(id(a))
            if seed is not None:  # drawn alone: the same draw again gives the same values
                again = responder._engine.generate([ids], a.new_tokens, 0.7, 0.9, responder._eos_ids, [seed],
                                                   chosen.folder, None, own)[0]
                assert again == a.token_ids and np.allclose(own[0], a.logprobs, atol=1e-4)
            with chosen.context:
                want = batch_token_logprobs(chosen.model, [torch.tensor(ids)], [torch.tensor(a.token_ids)], 0)[0]
            gaps += list(np.abs(np.array(a.logprobs) - np.array(want)))
    assert np.mean(gaps) < 0.1 and np.median(gaps) < 0.06, (np.mean(gaps), np.median(gaps), max(gaps))


def test_sampling_follows_the_seed_and_the_temperature(responder, adapters):
    _pointing(adapters, None)
    convo = [[{"role": "user", "content": "Tell me a story about a cat."}]]
    one = responder.answer_many(convo, seed=5, temperature=1.0, top_p=1.0, max_new_tokens=24)[0]
    again = responder.answer_many(convo, seed=5, temperature=1.0, top_p=1.0, max_new_tokens=24)[0]
    other = responder.answer_many(convo, seed=6, temperature=1.0, top_p=1.0, max_new_tokens=24)[0]
    assert one.token_ids == again.token_ids and one.token_ids != other.token_ids
    assert len(one.token_ids) <= 24 and (one.finish_reason == "length") == (len(one.token_ids) == 24)
    # No seed: each answer draws afresh, alone or in a batch (a chat's, a bot's, `serve`'s requests)
    alone = {tuple(responder.answer(convo[0], temperature=1.0, top_p=1.0, max_new_tokens=24).token_ids)
             for _ in range(3)}
    batch = responder.answer_many(convo * 4, temperature=1.0, top_p=1.0, max_new_tokens=24)
    assert len(alone) == 3 and len({tuple(a.token_ids) for a in batch}) == 4


def test_a_stop_string_ends_llama_cpps_drawing_alone_and_in_a_batch(responder, adapters):
    from test_stop_strings import early_stops

    from rlfleet.shared.chat_prompt import prompt_ids

    _pointing(adapters, "v0001")
    convs = [[{"role": "user", "content": p}] for p in PROMPTS[2:]]
    stop, k, ids = early_stops(responder, convs, temperature=0)
    rows = [prompt_ids(responder.tokenizer, responder._with_system(c)) for c in convs]
    drawn = responder._engine.generate(rows, 24, 0.0, 1.0, responder._eos_ids, None, adapters / "v0001",
                                       stop=lambda row, new: row == 0 and stop in responder.tokenizer.decode(new))
    assert drawn[0] == ids[:k] and len(drawn[1]) > k  # the row without a stop string drew on


def test_an_adapter_llama_cpp_cannot_take_is_answered_by_torch_and_said_once(responder, adapters, caplog,
                                                                             monkeypatch):
    import shutil

    from rlfleet.shared import llamacpp_engine

    shutil.copytree(adapters / "v0001", adapters / "v0002")
    real = llamacpp_engine.write_lora_gguf

    def refuse_v0002(folder, *args, **kwargs):
        if folder.name == "v0002":
            raise LoraConversionError("a part llama.cpp has no form for")
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(llamacpp_engine, "write_lora_gguf", refuse_v0002)
    _pointing(adapters, "v0002")
    try:
        with caplog.at_level(logging.WARNING, logger="rlfleet.shared.responder"):
            answers = [responder.answer([{"role": "user", "content": p}], seed=0) for p in PROMPTS[:2]]
            many = responder.answer_many([[{"role": "user", "content": p}] for p in PROMPTS[:2]])
        gaps = _rank_gaps(responder, answers + many)
    finally:
        _pointing(adapters, "v0001")
    assert all(a.adapter_version == "v0002" and a.new_tokens > 0 and a.logprobs for a in answers + many)
    assert caplog.text.count("llama.cpp cannot answer this") == 1
    assert max(gaps) < 1e-3, gaps  # torch's own greedy answers


def test_a_llama_cpp_that_cannot_decode_is_found_in_a_child_process(tmp_path):
    from rlfleet.shared.llamacpp_engine import decodes

    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert not decodes(bad, False)


def test_llama_cpps_own_log_probs_are_near_the_recorded_torch_ones(responder, adapters):
    """The numerics that drew a token (llama.cpp's quantised products) against the fp32 log-probs the
    answer records: the same distribution up to rounding, not another policy."""
    from rlfleet.shared.responder import batch_token_logprobs

    _pointing(adapters, None)
    gaps = []
    for i, p in enumerate(PROMPTS):
        msgs = responder._with_system([{"role": "user", "content": p}])
        ids = responder.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True,
                                                      return_tensors="pt")["input_ids"][0].tolist()
        own: list[list[float]] = []
        with responder._lock:
            chosen = responder._select(None)
            assert chosen.folder is None
            out = responder._engine.generate([ids], 24, 0.7, 0.9, responder._eos_ids, [i], None, None, own)[0]
            with chosen.context:
                want = batch_token_logprobs(chosen.model, [torch.tensor(ids)], [torch.tensor(out)], 0)[0]
        assert len(own[0]) == len(out) == len(want)
        gaps += list(np.abs(np.array(own[0]) - np.array(want)))
    # the chat's sampling; a misread logits row or another state would be off by nats, not hundredths
    assert np.mean(gaps) < 0.1 and np.median(gaps) < 0.06, (np.mean(gaps), np.median(gaps), max(gaps))


def test_a_prompt_after_a_prompt_reuses_the_shared_prefix_and_draws_the_same(responder, adapters):
    _pointing(adapters, None)
    engine = responder._engine
    msgs = [responder._with_system([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    rows = [responder.tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True,
                                                    return_tensors="pt")["input_ids"][0].tolist() for m in msgs]
    with responder._lock:
        responder._select(None)
        engine._cached = []  # from an empty memory
        alone = engine.generate([rows[1]], 16, 0.0, 1.0, responder._eos_ids)[0]
        engine.generate([rows[0]], 16, 0.0, 1.0, responder._eos_ids)
        before = engine.reused
        after_other = engine.generate([rows[1]], 16, 0.0, 1.0, responder._eos_ids)[0]
        shared = engine.reused - before
        engine.generate(rows, 4, 0.0, 1.0, responder._eos_ids)  # a batch starts over, and so does the next
        before = engine.reused
        engine.generate([rows[1]], 4, 0.0, 1.0, responder._eos_ids)
    common = next(i for i, (a, b) in enumerate(zip(*rows, strict=False)) if a != b)
    assert shared == common > 10  # the system prompt and the turn's opening, not the question
    assert after_other == alone
    assert engine.reused == before


def test_a_batch_decodes_what_its_prompts_share_once_and_draws_the_same(responder, adapters, monkeypatch):
    """The system prompt every row begins with, and a prompt asked again, are decoded once and their keys
    and values copied to the other rows' sequences: every row draws, token for token, what it draws when
    each prompt is decoded whole in its own sequence, with the adapter on too; from the base, what it
    draws alone."""
    engine = responder._engine
    msgs = [responder._with_system([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    rows = [responder.tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=True,
                                                    return_tensors="pt")["input_ids"][0].tolist() for m in msgs]
    batch = [rows[0], rows[1], rows[0], rows[2], rows[0], rows[1]]
    seeds = [11, 12, 13, 14, 15, 16]
    common = min(next(i for i, (a, b) in enumerate(zip(rows[0], r, strict=False)) if a != b) for r in rows[1:])

    def draw(prompts, row_seeds, weights, copies=True):
        monkeypatch.setattr(engine, "_copies", copies)
        return engine.generate(prompts, 12, 0.8, 0.95, responder._eos_ids, row_seeds, weights)

    for version in (None, "v0001"):
        _pointing(adapters, version)
        weights = None if version is None else adapters / version
        with responder._lock:
            responder._select(None)
            before = engine.shared
            together = draw(batch, seeds, weights)
            shared = engine.shared - before
            whole = draw(batch, seeds, weights, copies=False)
            alone = [draw([r], [s], weights)[0] for r, s in zip(batch, seeds, strict=True)]
        assert together == whole
        assert len({tuple(t) for t in together}) > 1  # the seeds draw different answers
        if version is None:  # (an adapter's products in a batch of rows differ from one row's by rounding)
            assert together == alone
        # the common prefix once, each distinct prompt's rest once, every row's last token its own
        assert shared == sum(len(r) - 1 for r in batch) - common - sum(len(r) - 1 - common for r in rows) > 0
    _pointing(adapters, None)


def test_the_base_shape_for_adapters_comes_from_the_loaded_model_as_from_the_file(responder):
    from rlfleet.shared.lora_gguf import BaseShape

    engine = responder._engine
    assert engine._meta("no.such.key") is None
    shape = BaseShape.read(engine._meta, str(engine.gguf_path))
    assert shape == BaseShape.of(engine.gguf_path) == BaseShape("llama", 30, 9, 3)


# ------------------------------------------------------------------- the trainer's samples (drawing.py)

def _trainer_gaps(trainer, convs, answers) -> list[float]:
    """:func:`_gaps` of the trainer's answers under the weights it has in use now."""
    from rlfleet.shared.chat_prompt import prompt_ids

    rows = [(prompt_ids(trainer.tokenizer, c), a) for c, a in zip(convs, answers, strict=True)]
    return _gaps(trainer._active(), rows)


def test_a_run_draws_with_llama_cpp_from_saved_weights_and_from_its_weights_as_they_train(ref, adapters, tmp_path):
    from dataclasses import replace

    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.presets import preset
    from rlfleet.worker.training.drawing import DRAW_BATCH
    from rlfleet.worker.training.torch_backend import Trainer

    trainer = Trainer(ref)
    trainer.draw_with("auto")
    drawer = trainer.drawer
    assert not drawer.loaded
    trainer.draw_with("auto", load=True)  # the training worker's preload
    assert drawer.loaded and drawer.drawn == 0
    # The gate's answers are drawn in one batch (as many rows as llama.cpp's batched rate rises for).
    assert drawer._engine.max_batch == DRAW_BATCH >= GateConfig().eval_samples
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    end = trainer.tokenizer.eos_token_id

    def greedy() -> list[list[int]]:
        return trainer.sample(convs, 12, seed=0, temperature=0.0)

    base = greedy()
    assert drawer.engine == "llama.cpp" and drawer.drawn == len(PROMPTS)
    assert all(0 < len(a) <= 12 and end not in a for a in base)
    assert any(len(a) < 12 for a in base)  # an answer that ended: its end token is cut, as torch's are
    gaps = _trainer_gaps(trainer, convs, base)
    assert max(gaps) < 0.5 and np.mean(gaps) < 0.05, gaps

    with trainer.adapter(adapters / "v0001", None):  # the gate's candidate: a saved folder
        tuned = greedy()
        assert drawer.drawn == 2 * len(PROMPTS) and tuned != base
        gaps = _trainer_gaps(trainer, convs, tuned)
        assert max(gaps) < 0.5 and np.mean(gaps) < 0.05, gaps  # llama.cpp drew with that adapter

    cfg = replace(preset("balanced"), lr=1e-3)
    with trainer.adapter(adapters / "v0001", cfg, trainable=True):  # a run, before its first step: explores
        assert greedy() == tuned and drawer.drawn == 3 * len(PROMPTS)
        trainer.begin_training(cfg)
        trainer.begin_step()
        with torch.no_grad():  # a step that takes the adapter back to the base
            for name, p in trainer._model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        trainer.finish_step(apply=True)
        with trainer.reference():  # the base, whatever the run has done to its adapter
            assert greedy() == base and drawer.drawn == 4 * len(PROMPTS)
        # The loop checks: the weights as they are now, saved for llama.cpp (not v0001's folder), and
        # the private folder gone afterwards.
        before = set(Path(tempfile.gettempdir()).glob("rlfleet-live-adapter-*"))
        assert greedy() == base and drawer.drawn == 5 * len(PROMPTS)
        assert set(Path(tempfile.gettempdir()).glob("rlfleet-live-adapter-*")) == before

    trainer.draw_with("torch")
    greedy()
    assert drawer.drawn == 5 * len(PROMPTS) and drawer.engine == "torch"


def test_the_trainers_draws_are_cut_into_parts_that_fit_llama_cpps_context():
    from rlfleet.worker.training.drawing import _before_end, _fitting

    prompts = [[1] * 10, [2] * 10, [3] * 50, [4] * 10]
    assert _fitting(prompts, 10, max_batch=2, n_ctx=100) == [[[1] * 10, [2] * 10], [[3] * 50, [4] * 10]]
    assert _fitting(prompts, 10, max_batch=8, n_ctx=100) == [[[1] * 10, [2] * 10, [3] * 50], [[4] * 10]]
    assert _fitting([[1] * 200], 10, max_batch=8, n_ctx=100) == [[[1] * 200]]  # llama.cpp refuses it: torch draws
    assert _before_end([5, 6, 2, 7], {2}) == [5, 6] and _before_end([5, 6], {2}) == [5, 6]


@pytest.mark.parametrize("engine", ["llama.cpp", "torch"])
def test_the_gates_answers_to_a_prompt_are_seeded_by_it_and_the_bases_are_drawn_once(ref, adapters, engine,
                                                                                       monkeypatch):
    """Where llama.cpp or the trainer's own decoding (worker/training/decoding.py) draws, the gate's
    i-th answer to a held-out prompt is seeded by the prompt and i: the same answer whichever batch
    drew it, so the worker draws the base's ahead (worker/idle_work.py) and the gate reads them; the
    candidate gets the same seeds, so its answers differ from the base's by the models alone."""
    from dataclasses import replace

    from rlfleet.worker.gate import GateConfig
    from rlfleet.worker.idle_work import _draw_held
    from rlfleet.worker.orchestrate import GateReferences
    from rlfleet.worker.samples import TrainSample
    from rlfleet.worker.training import decoding, feature_memo, torch_backend
    from rlfleet.worker.training.scoring import draw_held, held_known, sample_answers
    from rlfleet.worker.training.torch_backend import Trainer

    trainer = Trainer(ref)
    trainer.draw_with(engine, load=True)
    # Exactly the same answer in any batch needs fp32 products: bf16 ones round a row's hidden states
    # a little differently with the batch's padding, and a draw can part ways after a few tokens.
    trainer._draw_bf16 = False
    decoded = []  # rows the trainer's own decoding drew
    draw = decoding.draw
    monkeypatch.setattr(decoding, "draw",
                        lambda body, head, rows, *a: decoded.extend(rows) or draw(body, head, rows, *a))

    class Drawn:  # answers drawn by whichever engine draws
        @property
        def drawn(self) -> int:
            return trainer.drawer.drawn + len(decoded)

    drawer = Drawn()
    cfg = GateConfig(eval_samples=6, eval_new_tokens=10, eval_temperature=1.0, eval_top_p=1.0)
    p1, p2 = ([{"role": "user", "content": p}] for p in PROMPTS[2:])
    assert trainer.rows_seeded
    both = sample_answers(trainer, [p1, p2], cfg, 0)  # the plan: p1, p2, p1, p2, p1, p2
    alone = sample_answers(trainer, [p2], replace(cfg, eval_samples=3), 0)
    assert alone == both[1::2] and len(set(map(tuple, both[1::2]))) > 1  # three draws, not one thrice

    drawn: dict = {}
    assert draw_held(trainer, [(p1, 3)], cfg, 0, drawn, stop=lambda: True) == 0 and drawn == {}
    assert draw_held(trainer, [(p1, 2)], cfg, 0, drawn) == 2 and held_known(trainer, [p1, p2], cfg, 0, drawn) == 2
    before = drawer.drawn
    assert sample_answers(trainer, [p1, p2], cfg, 0, drawn) == both  # the third p1 and p2's three drawn now
    assert drawer.drawn == before + 4 and held_known(trainer, [p1, p2], cfg, 0, drawn) == 6
    assert sample_answers(trainer, [p1, p2], cfg, 0, drawn) == both and drawer.drawn == before + 4

    # The gate: the base's answers drawn ahead by the worker's idle work are read, the candidate's drawn.
    feature_memo.forget(trainer)
    held = [TrainSample(rating_id=i, prompt=p, response="Sure.", reward=r) for i, (p, r) in
            enumerate([(p1, 1.0), (p2, -1.0)])]
    gcfg = replace(cfg, eval_samples=4)
    assert _draw_held(trainer, [(p1, 2), (p2, 2)], gcfg, lambda: False) == 2
    before = drawer.drawn
    refs = GateReferences.measure(trainer, held, None, gcfg, 64)
    assert refs.base_known == 4 and drawer.drawn == before
    verdict = refs.judge(trainer, adapters / "v0001")
    assert verdict.metrics["gate_base_known"] == 4 and drawer.drawn == before + 4

    assert (trainer.drawer.drawn == 0) == (engine == "torch")  # the engine asked for drew them all
    assert (len(decoded) == 0) == (engine == "llama.cpp")

    # A model whose logits are more than its head's product: transformers' generate draws, one stream
    # per batch; nothing remembered, nothing drawn ahead.
    trainer.draw_with("torch")
    monkeypatch.setattr(torch_backend, "_decoder", lambda model: None)
    assert not trainer.rows_seeded and held_known(trainer, [p1, p2], cfg, 0, drawn) == 0
    assert draw_held(trainer, [(p2, 9)], cfg, 0, drawn) == 0
    feature_memo.forget(trainer)
