"""Exploration with the user's reward model (worker/training/exploration.py): the group-relative
advantages on plain numbers, K sampled answers per prompt on both backends, and runs on the tiny model
that explore (separable ratings, AUC over the bar) or say why they do not."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_trainer import LEARN, chat, preference_samples

from rlfleet.shared.models import resolve_model
from rlfleet.worker.samples import TrainSample
from rlfleet.worker.training import exploration, feature_memo, reward_features
from rlfleet.worker.training.advantages import group_advantages
from rlfleet.worker.training.reward_features import RewardModelReport

# ---- plain numbers -------------------------------------------------------------------------------


def test_group_advantages_are_centred_probabilities_not_z_scores():
    logit = lambda p: float(np.log(p / (1 - p)))  # noqa: E731
    adv = group_advantages([logit(0.9), logit(0.1), logit(0.1), logit(0.1)], weight=0.5, clip=2.0)
    assert adv == pytest.approx([0.6, -0.2, -0.2, -0.2], abs=1e-6)  # p - mean p, times 2 * 0.5
    assert sum(adv) == pytest.approx(0.0, abs=1e-6)
    # A group of answers the user would all dislike: the reward model's noise among them is no push.
    unliked = group_advantages([logit(0.02), logit(0.03), logit(0.01), logit(0.04)], 0.5, 2.0)
    assert max(abs(a) for a in unliked) < 0.02
    assert group_advantages([logit(0.99), logit(0.01)], 4.0, 1.5) == [1.5, -1.5]  # clipped
    assert group_advantages([1e9, -1e9], 0.5, 2.0) == pytest.approx([0.5, -0.5])  # no overflow


def test_a_group_with_nothing_to_compare_gets_zeros():
    assert group_advantages([0.3, 0.3, 0.3], 0.5, 2.0) == [0.0, 0.0, 0.0]
    assert group_advantages([1.7], 0.5, 2.0) == [0.0]
    assert group_advantages([], 0.5, 2.0) == []


def test_prompts_to_explore_are_distinct_newest_first_and_never_a_retractions():
    a, b, c = chat("a"), chat("b"), chat("c")
    samples = [TrainSample(1, a, "x", 1.0), TrainSample(5, b, "y", -1.0), TrainSample(3, a, "z", -1.0),
               TrainSample(9, c, "w", -1.0, fixed_advantage=0.5)]
    assert exploration.prompts_to_explore(samples, 16) == [b, a]
    assert exploration.prompts_to_explore(samples, 1) == [b]


def test_prompts_to_explore_take_rated_and_captured_prompts_in_turn():
    a, b, c, d, e = (chat(x) for x in "abcde")
    rated = [TrainSample(1, a, "x", 1.0), TrainSample(2, b, "y", -1.0), TrainSample(3, c, "z", -1.0)]
    # newest rated (c, b, a) and captured (d, b, e) alternate; b, rated and captured, comes once
    assert exploration.prompts_to_explore(rated, 16, [d, b, e]) == [c, d, b, a, e]
    assert exploration.prompts_to_explore(rated, 2, [d, b, e]) == [c, d]
    assert exploration.prompts_to_explore([], 2, [d, b, e]) == [d, b]  # no rated prompt: captured ones


def test_a_looping_answer_ranks_last_in_its_group_whatever_the_reward_model_says():
    fluent, looping = [1, 2, 3, 4, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2, 3]  # 4 of 7 trigrams repeated
    flags = exploration.loops([fluent, looping, fluent, looping])
    scores = exploration.fluent_first([5.0, 1.0, 2.0, 9.0], flags, [0, 0, 1, 1])
    assert scores == [5.0, 0.0, 2.0, 1.0]  # each looping answer 1 below its group's lowest
    assert exploration.fluent_first([3.0, 1.0], exploration.loops([fluent, fluent]), [0, 0]) == [3.0, 1.0]


def test_earlier_endings_are_the_answer_cut_at_its_first_sentence_ends():
    text = 'Rain is water. It falls, at 3.5 mm/h, "from clouds!" Really? Yes.'
    assert exploration.earlier_endings(text, 8) == [
        "Rain is water.", 'Rain is water. It falls, at 3.5 mm/h, "from clouds!"',
        'Rain is water. It falls, at 3.5 mm/h, "from clouds!" Really?']  # never the whole answer
    assert exploration.earlier_endings(text, 1) == ["Rain is water."]
    assert exploration.earlier_endings("One sentence.", 3) == exploration.earlier_endings("no end", 3) == []


def _shorter_is_better(batch):
    return [-float(len(s.response.split())) for s in batch]


def test_an_earlier_ending_is_added_only_where_the_reward_model_scores_it_higher():
    answers = [TrainSample(None, chat("a"), r, 0.0) for r in ("A b. C d. E f.", "Long one. More", "Fine.")]
    scored = [(s, score) for s, score in zip(answers, _shorter_is_better(answers), strict=True)]
    heads = exploration.ending_candidates(answers, 2)
    assert [[c.response for c in cuts] for cuts in heads] == [["A b.", "A b. C d."], ["Long one."], []]
    got = exploration.better_endings(scored, [list(zip(c, _shorter_is_better(c), strict=True)) for c in heads])
    assert [(i, s.response, score) for i, s, score in got] == [(0, "A b.", -2.0), (1, "Long one.", -2.0)]
    assert all(s.rating_id is None and s.prompt == chat("a") and s.complete for _, s, _ in got)
    longer = [list(zip(c, [-x for x in _shorter_is_better(c)], strict=True)) for c in heads]
    assert exploration.better_endings([(s, -x) for s, x in scored], longer) == []


class _Tok:
    eos_token_id = 0

    def __init__(self, texts):
        self.texts = texts

    def decode(self, ids, skip_special_tokens=True):
        return self.texts[ids[0]]


class _Sampler:
    """Answers the run's prompts with fixed texts, one token id per text, in order."""

    def __init__(self, texts):
        self.tokenizer = _Tok(texts)

    def sample(self, rows, max_new_tokens, seed):
        return [[i] for i in range(len(rows))]


class _ShorterModel:
    def score(self, x):
        return -x[:, 0]


def _explore_two_prompts(monkeypatch, texts, **settings):
    """``explore`` over two rated prompts (q, the newest, first), two answers each from ``texts``, scored
    by a reward model that likes fewer words."""
    def words(batch):
        return np.array([[len(s.response.split())] for s in batch], dtype=float)

    monkeypatch.setattr(exploration, "features_with_endings",
                        lambda _b, batch, endings, _m, _known: (words(batch), [words(cuts) for cuts in endings]))
    report = RewardModelReport(0.9, "ok", 0.0, _ShorterModel())
    rated = [TrainSample(1, chat("p"), "x", 1.0), TrainSample(2, chat("q"), "y", -1.0)]
    cfg = replace(LEARN, explore=2, explore_prompts=2, explore_weight=0.5, **settings)
    return exploration.explore(_Sampler(texts), rated, report, cfg)


def test_explore_trains_each_better_ending_in_its_answers_group(monkeypatch):
    texts = ["Yes. And on and on.", "No.", "Maybe so. Then more. And more.", "Sure thing."]
    out = _explore_two_prompts(monkeypatch, texts, explore_cuts=2)
    assert [s.response for s in out.samples] == texts + ["Yes.", "Maybe so."]
    assert [s.prompt for s in out.samples] == [chat("q")] * 2 + [chat("p")] * 2 + [chat("q"), chat("p")]
    assert out.metrics()["explored_ended_earlier"] == 2 and out.metrics()["explored"] == 6
    # each prompt's group holds its answers and their endings, centred on the group
    q, p = [0, 1, 4], [2, 3, 5]
    assert sum(out.advantages[i] for i in q) == pytest.approx(0.0, abs=1e-6)
    assert sum(out.advantages[i] for i in p) == pytest.approx(0.0, abs=1e-6)
    assert out.advantages[0] < out.advantages[4] and out.advantages[2] < out.advantages[5]
    plain = _explore_two_prompts(monkeypatch, texts, explore_cuts=0)
    assert len(plain.samples) == 4 and plain.metrics()["explored_ended_earlier"] == 0


def test_the_explored_advantages_spread_is_reported_as_quartiles(monkeypatch):
    assert exploration.quartiles([]) is None
    assert exploration.quartiles([0.4, 0.0, 0.1, 0.2]) == [0.1, 0.2, 0.4]
    # prompt q: two answers of one length (scored alike, advantage 0); prompt p: a short and a long one.
    texts = ["One two three.", "Four five six.", "Short.", "A much longer answer than that."]
    out = _explore_two_prompts(monkeypatch, texts, explore_cuts=0)
    assert out.advantages[:2] == [0.0, 0.0] and out.advantages[2] > 0 > out.advantages[3]
    m = out.metrics()
    got = [m["explored_abs_advantage_q1"], m["explored_abs_advantage_median"], m["explored_abs_advantage_q3"]]
    assert got == exploration.quartiles([abs(a) for a in out.advantages]) and got[0] == 0.0 < got[2]
    assert "explored_abs_advantage_median" not in exploration.Exploration(reason="off").metrics()


def test_explored_minibatches_hold_whole_prompt_groups_in_turn():
    groups = [0, 0, 1, 1, 2, 2, 3, 3, 0]  # the last: prompt 0's earlier ending, appended after the rest
    assert exploration.minibatches(groups, 2) == [[0, 1, 4, 5, 8], [2, 3, 6, 7]]
    assert exploration.minibatches(groups, 1) == [list(range(9))]
    assert exploration.minibatches(groups, 8) == [[0, 1, 8], [2, 3], [4, 5], [6, 7]]  # none empty
    assert exploration.minibatches([], 4) == []


def test_a_step_weighs_its_explored_minibatch_up_to_the_whole_runs_mean():
    from rlfleet.worker.training.policy_gradient import step_part, step_plan

    # 3 ratings, then 5 explored answers of prompts 0, 0, 1, 1, 0 in 2 minibatches (3 and 2 answers)
    parts, w = step_plan(8, [0, 0, 1, 1, 0], 2)
    assert parts == [[0, 1, 2], [3, 4, 7], [5, 6]]
    assert w[:3] == [pytest.approx(1 / 8)] * 3
    assert [w[i] for i in (3, 4, 7)] == [pytest.approx(5 / (3 * 8))] * 3
    assert [w[i] for i in (5, 6)] == [pytest.approx(5 / (2 * 8))] * 2
    for part in parts[1:]:  # each step's weights sum to one, as a plain mean over all would
        assert sum(w[i] for i in parts[0] + part) == pytest.approx(1.0)
    assert [step_part(s, len(parts)) for s in range(5)] == [1, 2, 1, 2, 1]
    # One minibatch: every step trains everything with equal weights, as without minibatches.
    parts, w = step_plan(8, [0, 0, 1, 1, 0], 1)
    assert parts == [[0, 1, 2], [3, 4, 5, 6, 7]] and w == [pytest.approx(1 / 8)] * 8
    assert [step_part(s, 2) for s in range(3)] == [1, 1, 1]
    assert step_plan(3, [], 4) == ([[0, 1, 2]], [pytest.approx(1 / 3)] * 3) and step_part(5, 1) == 0


def test_why_not_explore():
    cfg = replace(LEARN, explore=4, reward_model_min_auc=0.75)
    model = object()
    assert exploration.why_not(RewardModelReport(0.9, "ok", 0.0, model), cfg) is None
    assert exploration.why_not(RewardModelReport(0.9, "ok", 0.0, model), replace(cfg, explore=0)) == (
        "off (train.explore = 0)")
    low = exploration.why_not(RewardModelReport(0.7, "ok", 0.0, model), cfg)
    assert low == "reward model AUC 0.700 below train.reward_model_min_auc 0.75"
    none = exploration.why_not(RewardModelReport(None, "too few", 0.0), cfg)
    assert none == "no reward model: too few"


# ---- on the backends -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlx_trainer(tiny_model_dir):
    pytest.importorskip("mlx.core", exc_type=ImportError, reason="the MLX backend needs mlx: pip install -e '.[mlx]'")
    pytest.importorskip("mlx_lm", exc_type=ImportError, reason="the MLX backend needs mlx-lm: pip install -e '.[mlx]'")
    from rlfleet.worker.training.mlx_backend import MlxTrainer

    return MlxTrainer(resolve_model(str(tiny_model_dir)))


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_sample_gives_k_seeded_answers_per_prompt_cut_at_the_end_token(backend_name, tiny_trainer, request):
    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    prompts, k = [chat("Tell me about cats."), chat("What is rain?")], 3
    rows = [p for p in prompts for _ in range(k)]
    first = backend.sample(rows, 12, seed=7)
    assert len(first) == len(prompts) * k
    assert backend.sample(rows, 12, seed=7) == first  # seeded: the same answers again
    eos = backend.tokenizer.eos_token_id
    assert all(len(ids) <= 12 and eos not in ids for ids in first)
    assert len({tuple(ids) for ids in first}) > 1  # the rows are separate draws, not one answer repeated
    assert backend.sample(rows, 12, seed=8) != first


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_sample_honours_temperature_and_top_p(backend_name, tiny_trainer, request):
    """The gate samples the way the chat answers: temperature 0 is the likeliest answer, and a
    nucleus so small that it holds one token is that answer too, whatever the seed; the full
    distribution at the same temperature is not."""
    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    rows = [chat("Tell me about cats."), chat("What is rain?")] * 2
    greedy = backend.sample(rows, 12, seed=1, temperature=0.0)
    assert greedy[:2] == greedy[2:]  # no draw: the same prompt gives the same answer
    assert backend.sample(rows, 12, seed=2, temperature=0.0) == greedy
    assert backend.sample(rows, 12, seed=3, temperature=1.0, top_p=1e-6) == greedy
    assert backend.sample(rows, 12, seed=3, temperature=1.0, top_p=1.0) != greedy


def test_mlx_draws_the_torch_trainers_answers_in_one_batch(tiny_trainer, mlx_trainer, monkeypatch, caplog):
    """The MLX trainer draws a batch's answers together, by the torch trainer's rules: from the same
    weights and seeds the same answers, a row the same alone as in its batch, and the same again on a
    model whose cache does not batch (each row then drawn alone)."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    from rlfleet.worker.training import mlx_decoding

    rows = [chat("Tell me about cats."), chat("What is rain?"), chat("Hi"), chat("Name three colours, please.")] * 2
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        drawn = mlx_trainer.sample(rows, 12, seed=5, temperature=temperature, top_p=top_p)
        assert drawn == tiny_trainer.sample(rows, 12, seed=5, temperature=temperature, top_p=top_p)
        assert len({tuple(a) for a in drawn}) > 4  # separate draws, not the prompts' answers repeated
        assert mlx_trainer.sample(rows[5:], 12, seed=0, seeds=[10, 11, 12], temperature=temperature,
                                  top_p=top_p) == drawn[5:]

    forwards: list[int] = []  # the rows of each forward of the model

    class Counted:
        def __init__(self, model: object) -> None:
            self.model = model

        def __getattr__(self, name: str) -> object:
            return getattr(self.model, name)

        def __call__(self, ids: mx.array, cache: list) -> mx.array:
            forwards.append(ids.shape[0])
            return self.model(ids, cache=cache)

    monkeypatch.setattr(mlx_trainer, "model", Counted(mlx_trainer.model))
    assert mlx_trainer.sample(rows, 12, seed=5, temperature=0.7, top_p=0.9) == drawn
    assert forwards[0] == len(rows) and len(forwards) <= 12  # a forward per token for the batch, not per row
    # A row that ends leaves the batch, and the others draw on as they would have: the answers cut at a
    # token made an end token, from fewer rows each step.
    common = Counter(t for a in drawn for t in a[1:]).most_common(1)[0][0]
    monkeypatch.setattr(mlx_trainer, "_end_ids", [*mlx_trainer._end_ids, common])
    forwards.clear()
    cut = mlx_trainer.sample(rows, 12, seed=5, temperature=0.7, top_p=0.9)
    assert cut == [a[:a.index(common)] if common in a else a for a in drawn] != drawn
    assert forwards[-1] < forwards[0] == len(rows) and forwards == sorted(forwards, reverse=True)
    monkeypatch.setattr(mlx_trainer, "_end_ids", mlx_trainer._end_ids[:-1])

    def refuse(cls: type, caches: list) -> None:  # as mlx_lm says it of a cache that does not batch
        raise ValueError(f"{cls} does not yet support batching with history")

    forwards.clear()
    monkeypatch.setattr(mlx_cache.KVCache, "merge", classmethod(refuse))
    monkeypatch.setattr(mlx_decoding, "_said", set())  # (what an earlier test in this process may have said)
    with caplog.at_level(logging.WARNING, logger="rlfleet.worker.training.mlx_decoding"):
        assert mlx_trainer.sample(rows, 12, seed=5, temperature=0.7, top_p=0.9) == drawn
        assert set(forwards) == {1} and len(forwards) > len(rows)  # each row drawn alone
        assert mlx_trainer.sample(rows[:2], 4, seed=5) == [a[:4] for a in mlx_trainer.sample(rows[:2], 12, seed=5)]
    assert sum("drawn one at a time" in r.getMessage() for r in caplog.records) == 1  # said once, not per draw
    with pytest.raises(ValueError, match="2 prompts but 1 seeds"):
        mlx_trainer.sample(rows[:2], 4, seed=0, seeds=[1])


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_earlier_endings_get_the_features_they_get_encoded_alone(backend_name, tiny_trainer, request, monkeypatch):
    """The reward model sees an answer ended earlier as it sees that answer encoded as a row of its own;
    on the torch backend an ending whose tokens begin its answer's costs no row (one position in its
    answer's pass), one that does not is encoded alone."""
    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    rain = chat("Tell me about rain.")
    answers = [TrainSample(None, rain, "Rain is water. It falls from clouds. Then it stops.", 0.0),
               TrainSample(None, chat("Cats?"), "Cats purr. They sleep a lot", 0.0, complete=False),
               TrainSample(None, chat("Hi"), "Hello there", 0.0)]
    heads = exploration.ending_candidates(answers, 2)
    assert [len(h) for h in heads] == [2, 1, 0]
    stranger = TrainSample(None, rain, "Snow is cold.", 0.0)  # not this answer's beginning
    heads[0].append(stranger)
    pooled_rows: list[int] = []
    real = backend.pooled_hidden
    monkeypatch.setattr(backend, "pooled_hidden",
                        lambda batch: pooled_rows.append(len(batch["input_ids"])) or real(batch))
    own, ended = reward_features.features_with_endings(backend, answers, heads, 1024)
    encoded_alone = sum(pooled_rows)
    monkeypatch.setattr(backend, "pooled_hidden", real)
    assert np.allclose(own, reward_features.features(backend, answers, 1024), atol=1e-4)
    assert [x.shape[0] for x in ended] == [3, 1, 0]
    for cuts, x in zip(heads, ended, strict=True):
        if cuts:
            assert np.allclose(x, reward_features.features(backend, cuts, 1024), atol=1e-4)
    # the three endings differ from their answers and from each other
    assert not np.allclose(ended[0][0], own[0], atol=1e-3) and not np.allclose(ended[0][0], ended[0][1], atol=1e-3)
    if backend_name == "torch":
        assert encoded_alone == 1  # the stranger alone
    else:
        assert encoded_alone == len(answers) + 4  # every answer and every ending a row of its own


def _run(backend, samples, cfg, out, captured=(), history=(), progress=None):
    from rlfleet.worker.training.loop import RunRequest, run_training
    from rlfleet.worker.training.policy_gradient import PolicyGradient

    return run_training(backend, PolicyGradient(), RunRequest(samples, None, cfg, None, out, captured=captured,
                                                                history=history, progress=progress))


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_a_run_over_the_bar_explores_k_answers_per_prompt_that_are_not_ratings(backend_name, tiny_trainer, request,
                                                                               tmp_path, monkeypatch):
    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    samples = preference_samples()[:8]  # 4 prompts, each with a liked and a disliked answer: AUC 1.0
    cfg = replace(LEARN, steps=1, explore=2, explore_prompts=3, explore_max_new_tokens=8)
    trained: list[list[TrainSample]] = []
    encoded = []
    from rlfleet.worker.training import policy_gradient

    real_train = policy_gradient.PolicyGradient.train

    def spy(self, backend, session, data, cfg, report):
        trained.append(list(data.samples))
        encoded.append(list(data.encoded))
        assert len(data.advantages) == len(data.samples) == len(data.encoded)
        return real_train(self, backend, session, data, cfg, report)

    monkeypatch.setattr(policy_gradient.PolicyGradient, "train", spy)
    phases: list[str] = []
    result = _run(backend, samples, cfg, tmp_path / "explored", progress=lambda p: phases.append(p.phase))
    assert phases[:2] == ["exploring", "reference"]  # status says what the run is doing before its steps
    m = result.metrics
    assert m["reward_model_auc"] == 1.0
    assert m["explored"] == 2 * 3
    assert m["explore_reason"] == "2 answers to each of 3 prompts, reward model AUC 1.000 >= 0.75"
    assert 0 < m["explore_seconds"] < m["seconds"]
    assert m["ratings_used"] == len(samples)
    extra = trained[0][len(samples):]
    assert trained[0][: len(samples)] == samples  # the ratings train as before, first
    assert len(extra) == 6 and all(s.rating_id is None and s.behaviour_logprobs is None for s in extra)
    newest = [samples[i].prompt for i in (7, 5, 3)]  # rating ids 7, 5, 3: the newest prompts
    # An answer as long as the cap was cut off, not ended by the model: it trains without an end token.
    eos = backend.tokenizer.eos_token_id
    ends = [e.input_ids[-1] == eos for e in encoded[0][len(samples):]]
    assert ends == [s.complete for s in extra]
    assert m["explored_cut"] == ends.count(False) > 0  # the tiny model rarely ends within 8 tokens
    assert all(e.input_ids[-1] == eos for e in encoded[0][: len(samples)])
    assert [s.prompt for s in extra] == [p for p in newest for _ in range(2)]
    # A prompt nobody rated is explored in turn with the rated ones.
    asked = chat("Tell me about rain.")
    trained.clear()
    _run(backend, samples, replace(cfg, explore_prompts=2), tmp_path / "asked", captured=[asked])
    assert [s.prompt for s in trained[0][len(samples):]] == [samples[7].prompt] * 2 + [asked] * 2
    # The ledger sees the ratings only, with the advantages they get without exploration.
    alone = _run(backend, samples, replace(cfg, explore=0), tmp_path / "alone")
    assert result.advantages == alone.advantages and set(result.advantages) == {s.rating_id for s in samples}
    # The adapter loads.
    pairs = [(s.prompt, s.response) for s in samples[:2]]
    assert all(np.isfinite(backend.mean_logprobs(pairs, tmp_path / "explored")))


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_explored_minibatches_train_each_explored_answer_in_its_share_of_the_steps(backend_name, tiny_trainer,
                                                                                   request, tmp_path, monkeypatch):
    backend = tiny_trainer if backend_name == "torch" else request.getfixturevalue("mlx_trainer")
    samples = preference_samples()[:8]
    cfg = replace(LEARN, steps=4, unlikelihood=0.0, explore=2, explore_prompts=3, explore_max_new_tokens=8,
                  explore_cuts=0)
    rows_per_step: list[int] = []
    real_begin, real_accumulate = backend.begin_step, backend.accumulate

    def begin_step():
        rows_per_step.append(0)
        real_begin()

    def accumulate(batch, *args, **kwargs):
        rows_per_step[-1] += int(batch["input_ids"].shape[0])
        return real_accumulate(batch, *args, **kwargs)

    monkeypatch.setattr(backend, "begin_step", begin_step)
    monkeypatch.setattr(backend, "accumulate", accumulate)
    whole = _run(backend, samples, cfg, tmp_path / "whole").metrics
    assert rows_per_step == [8 + 6] * 4  # one minibatch: the 6 explored answers in every step
    rows_per_step.clear()
    split = _run(backend, samples, replace(cfg, explore_minibatches=2), tmp_path / "split").metrics
    # 3 prompts in 2 minibatches (prompts 0 and 2, then 1), in turn; the ratings in every step
    assert rows_per_step == [8 + 4, 8 + 2, 8 + 4, 8 + 2]
    assert split["explored"] == whole["explored"] == 6
    assert np.isfinite(split["final_mean_kl"]) and 0 < split["accepted_seq_frac"] <= 1


def test_a_runs_kl_check_reads_the_rated_answers_at_its_start_and_its_end_whatever_its_minibatches(
        tiny_trainer, tmp_path, monkeypatch):
    from rlfleet.worker.training import loop
    from rlfleet.worker.training.loop import RunRequest, run_training
    from rlfleet.worker.training.policy_gradient import PolicyGradient
    from rlfleet.worker.training.scoring import saved_adapter_kl

    samples = preference_samples()[:8]
    _run(tiny_trainer, samples, replace(LEARN, steps=2, explore=0), tmp_path / "parent")
    checks: list[tuple[float, float]] = []
    real_check = loop.run_check

    def spy(loss, start_kl, final_kl, max_run_kl):
        checks.append((start_kl, final_kl))
        return real_check(loss, start_kl, final_kl, max_run_kl)

    monkeypatch.setattr(loop, "run_check", spy)
    measured: list[int] = []  # response tokens of each micro-batch the model ran over for a KL
    real_kl = tiny_trainer.kl_sum
    monkeypatch.setattr(tiny_trainer, "kl_sum",
                        lambda batch, ref: measured.append(int(batch["response_mask"].sum())) or real_kl(batch, ref))
    cfg = replace(LEARN, steps=2, unlikelihood=0.0, explore=2, explore_prompts=3, explore_max_new_tokens=8,
                  explore_cuts=0)
    for n in (1, 3):
        result = run_training(tiny_trainer, PolicyGradient(), RunRequest(
            samples, None, replace(cfg, explore_minibatches=n), tmp_path / "parent", tmp_path / f"mb{n}"))
        assert result.metrics["explored"] == 6
        # The end: the saved adapter's KL on the 8 rated answers alone, one pass over their tokens only.
        rated_tokens = sum(len(tiny_trainer.tokenizer(s.response)["input_ids"]) for s in samples)
        assert sum(measured) <= rated_tokens + len(samples)  # (their end tokens), not the explored ones
        assert result.metrics["final_kl_seconds"] > 0  # that pass's time, reported with the run's
        measured.clear()
        assert checks[-1][1] == pytest.approx(saved_adapter_kl(tiny_trainer, samples, tmp_path / f"mb{n}", 1024),
                                              rel=1e-4, abs=1e-6)
    (start_1, _), (start_3, _) = checks
    assert start_1 > 0  # the parent has moved from the base
    # The start is the first step's own pass on the ratings, whatever explored minibatch trains beside them.
    assert start_3 == pytest.approx(start_1, rel=1e-4)


def test_explore_off_or_a_one_class_run_samples_nothing_and_says_why(tiny_trainer, tmp_path, monkeypatch):
    def no_sampling(*_a, **_k):
        raise AssertionError("nothing is sampled")

    monkeypatch.setattr(tiny_trainer, "sample", no_sampling)
    samples = preference_samples()[:8]
    off = _run(tiny_trainer, samples, replace(LEARN, steps=1), tmp_path / "off").metrics
    assert (off["explored"], off["explore_reason"]) == (0, "off (train.explore = 0)")
    liked = [s for s in samples if s.reward > 0]
    cfg = replace(LEARN, steps=1, explore=4)
    one = _run(tiny_trainer, liked, cfg, tmp_path / "one").metrics
    assert one["explored"] == 0 and one["reward_model_auc"] is None
    assert one["explore_reason"] == (
        "no reward model: too few rated answers of one class to cross-validate (4 liked, 0 disliked)")
    bar = _run(tiny_trainer, samples, replace(cfg, reward_model_min_auc=1.0 + 1e-9), tmp_path / "bar").metrics
    assert bar["explored"] == 0 and bar["explore_reason"].startswith("reward model AUC 1.000 below")


def test_the_reward_model_learns_from_earlier_ratings_too(tiny_trainer, tmp_path):
    samples = preference_samples()[:8]
    liked = [s for s in samples if s.reward > 0]
    disliked = [s for s in samples if s.reward < 0]
    run = [liked[0], *disliked]  # one liked answer in this run: too few to cross-validate alone
    cfg = replace(LEARN, steps=1)
    alone = _run(tiny_trainer, run, cfg, tmp_path / "alone").metrics
    assert alone["reward_model_auc"] is None and "(1 liked, 4 disliked)" in alone["reward_model_reason"]
    # The earlier ratings (one of them a replayed sample already in the run) make two liked answers.
    earlier = _run(tiny_trainer, run, cfg, tmp_path / "earlier", history=[liked[1], disliked[0]]).metrics
    assert earlier["reward_model_auc"] is not None and earlier["ratings_used"] == len(run)
    assert exploration.labelled(reward_features.with_history(run, [liked[1], disliked[0]])) == [*run, liked[1]]


def test_the_reference_and_behaviour_passes_reuse_the_feature_passes_log_probs(tiny_trainer, tmp_path, monkeypatch):
    """The rows a run's feature passes ran (its answers and their earlier endings) need no forward pass
    of their own for the base's or the starting policy's log-probs: they are the values a pass of
    their own gives. Weights an update moved are never answered from memory, nor another model's."""
    from rlfleet.worker.batching import encode_sample

    backend = tiny_trainer
    rain = chat("Tell me about rain.")
    answers = [TrainSample(None, rain, "Rain is water. It falls from clouds. Then it stops.", 0.0),
               TrainSample(None, chat("Cats?"), "Cats purr. They sleep a lot", 0.0, complete=False)]
    heads = exploration.ending_candidates(answers, 2)
    rows = [encode_sample(backend.tokenizer, s, 1024) for s in answers + [c for h in heads for c in h]]
    passes: list[int] = []
    real = backend._logprobs
    monkeypatch.setattr(backend, "_logprobs", lambda batch: passes.append(1) or real(batch))

    def log_probs() -> list:
        """Per micro-batch, the log-probs as the run asks for them, and as a pass of their own gives them."""
        groups, batches = backend.batches(rows, 64)  # small micro-batches: not the feature passes' own
        assert len(batches) > 1
        asked = [backend.logprobs(b) for b in batches]
        return [(lp[b["response_mask"]], real(b)[b["response_mask"]]) for b, lp in zip(batches, asked, strict=True)]

    def matches(got) -> bool:
        return all(torch.allclose(lp, own, atol=1e-5) for lp, own in got)

    cfg = replace(LEARN, steps=1)
    feature_memo.forget(backend)
    with backend.adapter(None, cfg, trainable=True):  # a fresh LoRA: the base until its first update
        reward_features.features_with_endings(backend, answers, heads, 1024)
        with backend.reference():
            base = log_probs()
        start = log_probs()
        assert passes == [] and matches(base) and matches(start)
        backend.begin_training(cfg)
        backend.begin_step()
        groups, batches = backend.batches(rows, 4096)
        for b in batches:
            n = len(b["input_ids"])
            backend.accumulate(b, real(b), real(b), backend.vector([1.0] * n), 1.0)
        backend.finish_step(apply=True)
        moved = log_probs()
        assert len(passes) == len(moved) and matches(moved)  # the updated policy: computed
        backend.save(tmp_path / "v1")
    passes.clear()
    with backend.adapter(tmp_path / "v1", cfg, trainable=True):  # a parent's session: the policy is not the base
        start = log_probs()
        assert len(passes) == len(start) and matches(start)  # nothing pooled under v1 yet: computed
        passes.clear()
        reward_features.features_with_endings(backend, answers, heads, 1024)
        start = log_probs()
        assert passes == [] and matches(start)
        with backend.reference():  # the base's, kept by the first session's feature passes
            base = log_probs()
        assert passes == [] and matches(base)
        with backend.teacher(None):  # the teacher reading a hint is the base: its remembered values too
            assert matches(log_probs())
        assert passes == []


def test_a_run_explores_with_the_answers_and_features_its_worker_drew_ahead(tiny_trainer, monkeypatch):
    """What the worker drew and pooled for a prompt while it waited is what the run explores: no draw
    and no pass of its own for it, the same features as a pass of its own gives; a prompt it did not
    draw ahead is drawn in the run and remembered."""
    backend = tiny_trainer
    cfg = replace(LEARN, explore=3, explore_prompts=2, explore_cuts=2, explore_max_new_tokens=24, max_tokens=96)
    rated = [TrainSample(1, chat("Tell me about rain."), "Rain falls.", 1.0),
             TrainSample(2, chat("Tell me about snow."), "Snow is cold. It is white.", -1.0)]
    report = RewardModelReport(0.9, "ok", 0.0, _ShorterModel())
    feature_memo.forget(backend)
    drawn: list[int] = []
    real = backend.sample
    monkeypatch.setattr(backend, "sample", lambda rows, *a, **k: drawn.append(len(rows)) or real(rows, *a, **k))
    with backend.adapter(None, cfg, trainable=True):
        memo = feature_memo.memo_for(backend, None, backend.precision)
        snow, rain = exploration.prompts_to_explore(rated, 2)  # the newest rating's prompt first
        assert exploration.draw_ahead(backend, [snow], cfg, memo) == 1
        assert exploration.draw_ahead(backend, [snow], cfg, memo, stop=lambda: True) == 0  # (held already)
        assert drawn == [3] and exploration.draw_key(snow, cfg) in memo.drawn
        ahead = memo.drawn[exploration.draw_key(snow, cfg)]
        out = exploration.explore(backend, rated, report, cfg, memo=memo)
        assert drawn == [3, 3]  # rain's three answers only
        assert out.metrics()["explored_known"] == 1 and out.metrics()["explored"] >= 6
        snow_answers = [s.response for s, g in zip(out.samples, out.groups, strict=True) if g == 0][:3]
        assert snow_answers == [backend.tokenizer.decode(a, skip_special_tokens=True) for a in ahead]
        assert exploration.draw_key(rain, cfg) in memo.drawn  # drawn in the run: remembered
        # The features it read are those a pass of its own gives (another batch: rounding only).
        explored, _, heads = exploration.as_samples(backend, [snow] * 3, ahead, cfg)
        read = reward_features.features_with_endings(backend, explored, heads, cfg.max_tokens, memo.pooled)
        own = reward_features.features_with_endings(backend, explored, heads, cfg.max_tokens)
        assert np.allclose(read[0], own[0], atol=1e-5)
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(read[1], own[1], strict=True))
        # Without the memo the run draws every prompt itself, as before.
        drawn.clear()
        plain = exploration.explore(backend, rated, report, cfg)
        assert drawn == [6] and plain.metrics()["explored_known"] == 0
    feature_memo.forget(backend)
