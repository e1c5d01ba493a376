"""LocalResponder on the tiny model: recorded log-probs, CURRENT hot swap, bad CURRENT files, seeding."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from rlfleet.shared.chat_prompt import prompt_ids  # noqa: E402
from rlfleet.shared.models import resolve_model  # noqa: E402
from rlfleet.shared.responder import Answer, LocalResponder  # noqa: E402

# peft 0.21 calls a transformers 5 method that is deprecated (is_gradient_checkpointing).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")

TOL = 1e-4
MSGS = [{"role": "user", "content": "Say something nice about tests."}]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(single_thread) -> None:
    """See tinymodel.one_torch_thread."""


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory) -> Path:
    """Two non-identity LoRA adapters, v0001 and v0002, saved once for the module."""
    root = tmp_path_factory.mktemp("store")
    for seed, version in ((1, "v0001"), (2, "v0002")):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        cfg = LoraConfig(r=4, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, cfg).save_pretrained(root / version)
    return root


@pytest.fixture
def adapters_dir(store, tmp_path) -> Path:
    folder = tmp_path / "adapters" / "tiny"
    shutil.copytree(store, folder)
    return folder


@pytest.fixture(scope="module")
def reference(tiny, store):
    """Independent fp32 forward pass: a freshly loaded base (+ adapter), whole-sequence logits."""
    tok = AutoTokenizer.from_pretrained(tiny)
    models: dict[str | None, object] = {}

    def logprobs(version: str | None, messages: list[dict], ids: list[int]) -> torch.Tensor:
        if version not in models:
            model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
            if version is not None:
                model = PeftModel.from_pretrained(model, str(store / version)).eval()
            models[version] = model
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        full = torch.tensor([list(prompt) + ids])
        with torch.no_grad():
            logits = models[version](input_ids=full).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 :]
        return lp.gather(-1, torch.tensor(ids).view(-1, 1)).squeeze(-1)

    return logprobs


def make(tiny: Path, adapters_dir: Path, **kw) -> LocalResponder:
    kw.setdefault("max_new_tokens", 16)
    return LocalResponder(resolve_model(str(tiny)), adapters_dir, **kw)


def max_gap(answer: Answer, expected: torch.Tensor) -> float:
    return (torch.tensor(answer.logprobs) - expected).abs().max().item()


def set_current(adapters_dir: Path, text: str | bytes | None) -> None:
    path = adapters_dir / "CURRENT"
    if text is None:
        path.unlink(missing_ok=True)
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)


def test_answer_records_raw_logprobs(tiny, adapters_dir, reference):
    r = make(tiny, adapters_dir)
    a = r.answer(MSGS, seed=0)
    assert isinstance(a.text, str)
    assert a.new_tokens == len(a.token_ids) == len(a.logprobs) > 0
    assert a.adapter_version is None and r.active_version is None
    assert a.model == str(tiny) and a.seconds > 0
    assert a.text == r.tokenizer.decode(a.token_ids, skip_special_tokens=True).strip()
    assert all(lp <= 0 for lp in a.logprobs)
    assert a.messages == MSGS
    assert max_gap(a, reference(None, MSGS, a.token_ids)) < TOL


def test_hot_swap_follows_current(tiny, adapters_dir, reference):
    r = make(tiny, adapters_dir)
    first = r.answer(MSGS, seed=5)
    assert first.adapter_version is None

    set_current(adapters_dir, "v0001\n")
    assert r.current_version() == "v0001"
    assert r.refresh() == "v0001"
    assert r.refresh() is None  # exactly once
    a1 = r.answer(MSGS, seed=5)
    assert a1.adapter_version == "v0001" == r.active_version
    assert max_gap(a1, reference("v0001", MSGS, a1.token_ids)) < TOL
    assert max_gap(a1, reference(None, MSGS, a1.token_ids)) > 1e-2  # the adapter really is in use

    set_current(adapters_dir, "v0002")  # picked up by answer() itself
    a2 = r.answer(MSGS, seed=5)
    assert a2.adapter_version == "v0002"
    assert r.refresh() is None
    assert max_gap(a2, reference("v0002", MSGS, a2.token_ids)) < TOL
    assert max_gap(a2, reference("v0001", MSGS, a2.token_ids)) > 1e-2
    assert list(r.model.peft_config) == ["v0002"]  # the old adapter was deleted

    set_current(adapters_dir, None)
    assert r.refresh() is None and r.active_version is None
    assert not isinstance(r.model, PeftModel)
    back = r.answer(MSGS, seed=5)
    assert back.adapter_version is None
    assert back.token_ids == first.token_ids and back.logprobs == first.logprobs  # the base, untouched
    assert max_gap(back, reference(None, MSGS, back.token_ids)) < TOL

    set_current(adapters_dir, "v0001")  # wrapping the base a second time works too
    again = r.answer(MSGS, seed=5)
    assert again.adapter_version == "v0001"
    assert again.token_ids == a1.token_ids
    assert max_gap(again, reference("v0001", MSGS, again.token_ids)) < TOL


def test_adapter_present_at_start_is_loaded(tiny, adapters_dir, reference):
    set_current(adapters_dir, "v0002")
    r = make(tiny, adapters_dir)
    assert r.active_version == "v0002" and r.refresh() is None
    a = r.answer(MSGS, seed=1)
    assert a.adapter_version == "v0002"
    assert max_gap(a, reference("v0002", MSGS, a.token_ids)) < TOL


@pytest.mark.parametrize(
    "content",
    ["", "  \n", "../v0001", "v0001/../v0002", "v0001 v0002", "x" * 300, b"\xff\xfe\x00v1", "v0009"],
    ids=["empty", "blank", "dotdot", "path", "two", "long", "binary", "missing"],
)
def test_bad_current_means_base(tiny, adapters_dir, reference, content, caplog):
    set_current(adapters_dir, "v0001")
    r = make(tiny, adapters_dir)
    assert r.active_version == "v0001"
    set_current(adapters_dir, content)
    with caplog.at_level(logging.WARNING, logger="rlfleet.shared.responder"):
        assert r.current_version() is None
        a = r.answer(MSGS, seed=2)
        r.answer(MSGS, seed=3)
    assert a.adapter_version is None and r.active_version is None
    assert max_gap(a, reference(None, MSGS, a.token_ids)) < TOL
    warnings = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    if content == "v0009":
        assert len(warnings) == 1 and "does not exist" in warnings[0].getMessage()
    if content.strip() if isinstance(content, str) else content:
        assert len(warnings) == 1  # logged once, not on every answer


def test_broken_adapter_keeps_previous(tiny, adapters_dir, reference, caplog):
    bad = adapters_dir / "v0003"
    shutil.copytree(adapters_dir / "v0001", bad)
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    empty = adapters_dir / "v0004"
    empty.mkdir()

    set_current(adapters_dir, "v0003")  # first load fails: the base must come out clean
    with caplog.at_level(logging.WARNING, logger="rlfleet.shared.responder"):
        r = make(tiny, adapters_dir)
        assert r.refresh() is None  # not retried until something changes
    assert r.active_version is None
    assert sum(rec.levelno >= logging.WARNING and "v0003" in rec.getMessage() for rec in caplog.records) == 1
    a = r.answer(MSGS, seed=4)
    assert a.adapter_version is None
    assert max_gap(a, reference(None, MSGS, a.token_ids)) < TOL

    set_current(adapters_dir, "v0001")
    assert r.refresh() == "v0001"
    for broken in ("v0003", "v0004"):  # a later failure keeps the previous adapter
        set_current(adapters_dir, broken)
        assert r.refresh() is None
        b = r.answer(MSGS, seed=4)
        assert b.adapter_version == "v0001"
        assert max_gap(b, reference("v0001", MSGS, b.token_ids)) < TOL
        assert list(r.model.peft_config) == ["v0001"]

    shutil.copy(adapters_dir / "v0002" / "adapter_model.safetensors", bad)  # repaired in place
    set_current(adapters_dir, "v0003")
    assert r.refresh() == "v0003"


def test_system_prompt(tiny, adapters_dir, reference):
    r = make(tiny, adapters_dir, system_prompt="You are terse.")
    a = r.answer(MSGS, seed=6)
    with_system = [{"role": "system", "content": "You are terse."}, *MSGS]
    assert a.messages == with_system
    assert max_gap(a, reference(None, with_system, a.token_ids)) < TOL
    own = [{"role": "system", "content": "Be verbose."}, *MSGS]
    b = r.answer(own, seed=6)
    assert b.messages == own
    assert max_gap(b, reference(None, own, b.token_ids)) < TOL


def test_seed_and_greedy(tiny, adapters_dir):
    r = make(tiny, adapters_dir)
    state = torch.random.get_rng_state()
    x, y, z = (r.answer(MSGS, seed=s) for s in (11, 11, 12))
    assert torch.equal(state, torch.random.get_rng_state())  # seeding leaves the global RNG alone
    assert x.token_ids == y.token_ids and x.logprobs == y.logprobs
    assert x.token_ids != z.token_ids
    g = make(tiny, adapters_dir, temperature=0)
    assert g.answer(MSGS).token_ids == g.answer(MSGS, seed=99).token_ids


def test_sample_answers_a_batch_as_one_by_one_answers_do(tiny, adapters_dir):
    """Left-padded prompts of different lengths in one generate call: greedy, each row is the answer the
    conversation gets alone (with the adapter and the system prompt); sampled, a seed repeats the batch."""
    set_current(adapters_dir, "v0001")
    convs = [[{"role": "user", "content": c}] for c in ("Hi.", "Tell me about tests, please.", "Why?")]
    g = make(tiny, adapters_dir, temperature=0, system_prompt="You are terse.")
    batch = g.sample(convs)
    alone = [g.answer(c) for c in convs]
    assert [s.token_ids for s in batch] == [a.token_ids for a in alone]
    assert [s.text for s in batch] == [a.text for a in alone]
    assert [s.messages for s in batch] == [a.messages for a in alone]
    assert {s.adapter_version for s in batch} == {"v0001"} and g.sample([]) == []
    r = make(tiny, adapters_dir)
    state = torch.random.get_rng_state()
    x, y = r.sample(convs * 2, seed=5), r.sample(convs * 2, seed=5)
    assert torch.equal(state, torch.random.get_rng_state())
    assert len(x) == 6 and [s.token_ids for s in x] == [s.token_ids for s in y]
    assert x[0].token_ids != x[3].token_ids  # the same conversation twice in a batch: two draws


def test_end_token_kept_and_scored(tiny, tmp_path, adapters_dir, reference):
    """A copy of the tiny model that ends answers often: the end token closes the ids, is scored,
    and is left out of the text."""
    folder = tmp_path / "eos-model"
    shutil.copytree(tiny, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder)
    eos = tok.eos_token_id
    with torch.no_grad():
        # Residual dimension 0 is a constant 1 (no layer writes it), and the end token's (tied)
        # embedding points along it: P(end) is about 0.2 at every step.
        emb = model.model.embed_tokens.weight
        emb[:, 0] = 1.0
        emb[eos] = 0.0
        emb[eos, 0] = 1.6
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
    model.save_pretrained(folder)

    ref = resolve_model(str(folder))
    r = LocalResponder(ref, adapters_dir, max_new_tokens=60, temperature=1.0, top_p=1.0)
    full = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tok.apply_chat_template(MSGS, add_generation_prompt=True, return_dict=True)["input_ids"]
    for seed in range(3):
        a = r.answer(MSGS, seed=seed)
        assert a.token_ids[-1] == eos and eos not in a.token_ids[:-1] and a.finish_reason == "stop"
        assert len(a.logprobs) == len(a.token_ids) < 60
        assert "<|im_end|>" not in a.text
        with torch.no_grad():
            logits = full(input_ids=torch.tensor([list(prompt) + a.token_ids])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1 :].gather(
            -1, torch.tensor(a.token_ids).view(-1, 1)
        ).squeeze(-1)
        assert max_gap(a, expected) < TOL
    capped = [r.answer(MSGS, seed=seed, max_new_tokens=2) for seed in range(10)]
    assert {a.finish_reason for a in capped} == {"stop", "length"}  # the end token, or the cap, came first
    assert all((a.finish_reason == "stop") == (a.token_ids[-1] == eos) for a in capped)
    assert all(len(a.token_ids) == 2 for a in capped if a.finish_reason == "length")
    batch = r.sample([MSGS] * 6, seed=0)  # rows that end early are cut at their end token, not padded
    assert all(eos not in s.token_ids[:-1] and "<|im_end|>" not in s.text for s in batch)
    assert all(s.token_ids[-1] == eos or len(s.token_ids) == 60 for s in batch)
    assert len({len(s.token_ids) for s in batch}) > 1 and any(s.token_ids[-1] == eos for s in batch)


def test_concurrent_answers_and_swaps(tiny, adapters_dir, reference):
    r = make(tiny, adapters_dir, max_new_tokens=8)
    results: list[Answer] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for i in range(3):
                results.append(r.answer(MSGS, seed=seed * 10 + i))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for version in ("v0001", "v0002", None, "v0001"):
        set_current(adapters_dir, version)
        r.refresh()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 6
    for a in results:  # every answer matches the version it reports
        assert max_gap(a, reference(a.adapter_version, MSGS, a.token_ids)) < TOL


def test_answer_many_gives_each_conversation_its_own_answer_with_its_raw_logprobs(tiny, adapters_dir, reference):
    """Many conversations in one generate and one log-prob pass: greedy, each is the answer it gets alone,
    and its log-probs are what a fresh fp32 forward of that conversation alone gives (left padding and
    the position ids change nothing)."""
    set_current(adapters_dir, "v0001")
    convs = [[{"role": "user", "content": c}] for c in ("Hi.", "Tell me about tests, please, in detail.", "Why?")]
    g = make(tiny, adapters_dir, temperature=0, max_new_tokens=12)
    many = g.answer_many(convs)
    alone = [g.answer(c) for c in convs]
    assert [a.token_ids for a in many] == [a.token_ids for a in alone]
    assert [a.finish_reason for a in many] == [a.finish_reason for a in alone]
    assert [a.prompt_tokens for a in many] == [a.prompt_tokens for a in alone] == [
        len(prompt_ids(g.tokenizer, c)) for c in convs]
    assert [a.adapter_version for a in many] == ["v0001"] * 3
    for got, conv in zip(many, convs, strict=True):
        assert got.messages == conv  # no system prompt set: the conversation as asked
        assert got.new_tokens == len(got.token_ids) == len(got.logprobs) > 0
        assert max_gap(got, reference("v0001", got.messages, got.token_ids)) < TOL
    sampled = make(tiny, adapters_dir, max_new_tokens=12)
    assert [a.token_ids for a in sampled.answer_many(convs, seed=5)] == \
        [a.token_ids for a in sampled.answer_many(convs, seed=5)]
    assert sampled.answer_many([]) == []


def test_the_batched_log_prob_pass_runs_a_shared_system_prompt_once_and_scores_as_alone(tiny, adapters_dir,
                                                                                        reference, monkeypatch):
    """Conversations that open alike (a long system prompt) share its keys and values in the log-prob
    pass: each answer's log-probs are still what a fresh forward of it alone gives."""
    from transformers import DynamicCache

    lent: list[int] = []
    real = DynamicCache.batch_repeat_interleave

    def spy(self, repeats: int) -> None:
        lent.append(repeats)
        real(self, repeats)

    monkeypatch.setattr(DynamicCache, "batch_repeat_interleave", spy)
    set_current(adapters_dir, "v0002")
    g = make(tiny, adapters_dir, temperature=1.0, top_p=1.0, max_new_tokens=10,
             system_prompt="You are a careful assistant who answers every question in plain and simple words.")
    convs = [[{"role": "user", "content": c}] for c in ("Hi.", "Tell me about tests, please.", "Why?", "Name one.")]
    many = g.answer_many(convs, seed=3)
    assert lent == [4]  # the prefix ran once, lent to the four rows
    for got in many:
        assert got.new_tokens == len(got.logprobs) > 0
        assert max_gap(got, reference("v0002", got.messages, got.token_ids)) < TOL


def test_a_conversation_cache_encodes_only_what_each_turn_adds_and_answers_as_without(tiny, adapters_dir,
                                                                                     reference):
    from rlfleet.shared.responder import TurnCache

    r = make(tiny, adapters_dir, max_new_tokens=6)
    cache, plain, cached = TurnCache(), [MSGS[0]], [MSGS[0]]
    lengths, reused = [], []
    for turn in range(4):
        if turn == 2:
            set_current(adapters_dir, "v0001")  # a new version mid-conversation: the cache starts over
        a = r.answer(plain, seed=turn)  # the whole conversation encoded, every turn
        before = cache.reused
        b = r.answer(cached, seed=turn, cache=cache)
        reused.append(cache.reused - before)
        assert b.token_ids == a.token_ids and b.adapter_version == a.adapter_version
        assert max_gap(b, reference(b.adapter_version, cached, b.token_ids)) < TOL
        lengths.append(len(r.tokenizer.apply_chat_template(cached, add_generation_prompt=True,
                                                           return_dict=True)["input_ids"]))
        plain = cached = [*cached, {"role": "assistant", "content": b.text or "ok"},
                          {"role": "user", "content": f"And turn {turn}?"}]
    assert cache.reused + cache.encoded == sum(lengths)
    # turns 1 and 3 take at least the turn before's prompt from the cache (its answer too, where the
    # answer's text tokenizes back to what was generated); turn 0 and turn 2, a new version, take nothing
    assert reused[0] == reused[2] == 0
    assert lengths[0] <= reused[1] < lengths[1] and lengths[2] <= reused[3] < lengths[3], (lengths, reused)


def test_each_scope_is_answered_by_its_own_adapter_beside_the_shared_one(tiny, adapters_dir, store, reference,
                                                                        caplog):
    from rlfleet.shared import scopes

    def give(key: str, version: str | None, source: Path | None = None) -> Path:
        folder = adapters_dir.parent / scopes.folder(scopes.lineage(adapters_dir.name, key))
        folder.mkdir(parents=True, exist_ok=True)
        if source is not None:
            shutil.copytree(source, folder / version)
        if version is not None:
            (folder / "CURRENT").write_text(version)
        return folder

    give("person:cli:alice", "v0001", store / "v0001")
    give("person:cli:bob", "v0002", store / "v0002")
    r = make(tiny, adapters_dir, max_adapters=1)  # one scope's adapter loaded at a time: the other reloads
    slots = []
    for _ in range(2):
        alice = r.answer(MSGS, seed=5, scope="person:cli:alice")
        slots.append(list(r.model.peft_config))
        bob = r.answer(MSGS, seed=5, scope="person:cli:bob")
        slots.append(list(r.model.peft_config))
        shared = r.answer(MSGS, seed=5)  # CURRENT of the shared lineage: none, the base
        assert (alice.adapter_version, bob.adapter_version, shared.adapter_version) == ("v0001", "v0002", None)
        assert max_gap(alice, reference("v0001", MSGS, alice.token_ids)) < TOL
        assert max_gap(bob, reference("v0002", MSGS, bob.token_ids)) < TOL
        assert max_gap(shared, reference(None, MSGS, shared.token_ids)) < TOL  # scopes' layers off for it
    assert all(names == slots[0] and len(names) == 1 for names in slots)  # one slot, its weights swapped in place
    assert r.answer(MSGS, seed=5, scope="person:cli:nobody").adapter_version is None  # no adapter yet: the base
    assert sum(n.startswith("scope-") for n in r.model.peft_config) == 1  # the least recently used let go

    set_current(adapters_dir, "v0002")  # the shared lineage moves on; the scopes keep theirs
    assert r.answer(MSGS, seed=5).adapter_version == "v0002"
    again = r.answer_many([MSGS, MSGS], seed=5, scope="person:cli:alice")
    assert [a.adapter_version for a in again] == ["v0001", "v0001"]
    assert max_gap(again[0], reference("v0001", MSGS, again[0].token_ids)) < TOL
    assert r.sample([MSGS], seed=5, scope="person:cli:bob")[0].adapter_version == "v0002"

    broken = give("person:cli:carol", "v0001")
    (broken / "v0001").mkdir()  # named by CURRENT, but holds no adapter
    with caplog.at_level(logging.WARNING):
        assert r.answer(MSGS, seed=5, scope="person:cli:carol").adapter_version is None
        assert r.answer(MSGS, seed=5, scope="person:cli:carol").adapter_version is None
    assert sum("scope person:cli:carol" in m for m in caplog.messages) == 1  # said once
    assert r.answer(MSGS, seed=5).adapter_version == "v0002"  # the rest goes on
