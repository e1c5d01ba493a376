"""rlfleet.gym's Agent on the tiny model, the real store, Redis and trainer: it learns an environment
where one action pays, its episodes are stored and shown like ratings, and misuse says what went wrong
without losing what was recorded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from rlfleet.cli.app import app
from rlfleet.gym import Agent, GymError
from rlfleet.gym.agent import Episode, discounted_returns, step_baselines
from rlfleet.gym.heldout import judge_returns, play_lockstep
from rlfleet.shared.models import model_slug
from rlfleet.shared.schema import CaptureRow
from rlfleet.shared.store import Store

runner = CliRunner()


class Pick(Agent):
    """A one-step environment's agent: the answer's first character is the action, "A" when its code
    point is even (a blank answer is "B")."""

    def get_system_prompt(self) -> str:
        return "Answer A or B."

    def format_observation(self, observation) -> str:
        return f"Round {observation}: A or B?"

    def extract_action(self, response: str) -> str:
        return "A" if response[:1] and ord(response[0]) % 2 == 0 else "B"


class Crashing(Pick):
    def extract_action(self, response: str) -> str:
        raise ValueError("no move in that")


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory):
    """The tiny model with weights at 0.1 (not 0.02): the default one cannot make any first byte much
    likelier than another however it is trained (tests/tinymodel.py), so no policy could pay more."""
    from tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("peaked-model"), init_range=0.1)


def held_out_rate(agent: Agent, n: int = 256) -> float:
    """How often the served version picks the paying action on observations it never trained on."""
    answers = agent.respond_many(4242)([agent.prompt_for(10_000 + i % 7) for i in range(n)], 0)
    return sum(agent.extract_action(a) == "A" for a in answers) / n


@pytest.mark.parametrize("prefix", ["", "Pick:"])
def test_the_agent_learns_the_action_that_pays_on_held_out_episodes(queued_home, peaked_model_dir, single_thread,
                                                                    prefix):
    """With an answer prefix too: the run trains on the byte after the prefill, read after it."""
    kind = Prefixed if prefix else Pick
    agent = kind(model=str(peaked_model_dir), home=queued_home, episodes_per_update=16, max_new_tokens=1,
                 device="cpu", preset="aggressive", lr=3e-3, answer_prefix=prefix)
    agent.seen = []
    try:
        before = held_out_rate(agent)
        runs = []
        for episode in range(256):
            action = agent.act(episode % 7)
            agent.assign_reward(1.0 if action == "A" else 0.0)
            stats = agent.terminate_episode()
            if stats is not None:
                runs.append(stats)
        after = held_out_rate(agent)
    finally:
        agent.close()
    assert len(runs) == 16 and all(r["episodes"] == 16 and r["turns"] == 16 for r in runs)
    trained = [r for r in runs if r["version"] is not None]
    assert trained and all(r["promoted"] for r in trained), runs
    assert agent.registry.current() == trained[-1]["version"]
    # measured here: about 0.26 before and 0.80 after (256 held-out answers each: noise about ±0.03)
    assert after - before >= 0.25, (before, after)
    assert sum(r["mean_return"] for r in runs[-4:]) / 4 > sum(r["mean_return"] for r in runs[:4]) / 4 + 0.2


class Prefixed(Pick):
    """Pick's agent with a prefill: the model writes only what follows "Pick:"; the action is the first
    character after it."""

    seen: list[str]  # every answer read, set per test

    def extract_action(self, response: str) -> str:
        self.seen.append(response)
        assert response.startswith("Pick:"), response
        return super().extract_action(response[len("Pick:"):].lstrip() or "B")


def test_an_answer_prefix_is_written_for_the_model_and_trained_on_what_follows(queued_home, tiny_model_dir,
                                                                                single_thread):
    from rlfleet.worker.batching import encode_sample
    from rlfleet.worker.samples import TrainSample

    agent = Prefixed(model=str(tiny_model_dir), home=queued_home, episodes_per_update=2, max_new_tokens=3,
                     device="cpu", answer_prefix="Pick:", heldout_env=lambda: OneStep(), heldout_episodes=4,
                     heldout_batch=2)
    agent.seen = []
    try:
        for _ in range(2):
            agent.act(0)
            agent.act(1)  # a second turn: the conversation holds the first answer, prefix and all
            agent.assign_reward(1.0)
            episode = agent._episode
            stats = agent.terminate_episode()
        assert stats is not None and stats["turns"] == 4
        heldout = agent.heldout_returns(None)
    finally:
        agent.close()
    assert len(agent.seen) >= 4 + 4 and all(s.startswith("Pick:") for s in agent.seen)
    first, second = episode.steps
    assert first.prompt[-1] == {"role": "assistant", "content": "Pick:"}
    assert second.prompt[-3]["role"] == "assistant" and second.prompt[-3]["content"].startswith("Pick:")
    assert second.prompt[-1] == {"role": "assistant", "content": "Pick:"}
    tok = agent.responder.tokenizer
    for step in episode.steps:
        # the answer as drawn, its leading space kept (" 1" after "Action:" must not become "1")
        assert step.response == tok.decode(step.token_ids, skip_special_tokens=True).rstrip()
        if "\ufffd" not in step.response:  # random bytes of the tiny model that are not UTF-8 cannot round-trip
            enc = encode_sample(tok, TrainSample(
                rating_id=1, prompt=step.prompt, response=step.response, reward=1.0,
                behaviour_logprobs=step.logprobs, behaviour_token_ids=step.token_ids,
                complete=step.finish_reason != "length"), max_tokens=4096)
            assert enc.behaviour_logprobs is not None, (step.response, step.token_ids)
    assert len(heldout) == 4
    with Store(agent.cfg.db_url).session() as s:
        prompts = [c.prompt for c in s.query(CaptureRow).filter(CaptureRow.source == "gym")]
    assert prompts and all(p[-1]["role"] == "assistant" and p[-1]["content"] == "Pick:" for p in prompts)


class OneStep:
    """A one-step environment: the observation is 0, any action ends it with a reward of 1 for "A"."""

    def reset(self, seed=None):
        return 0, {}

    def step(self, action):
        return 0, 1.0 if action == "A" else 0.0, True, False, {}


def test_episodes_are_stored_like_ratings_and_show_in_status_history_and_export(
        queued_home, tiny_model_dir, single_thread, tmp_path, monkeypatch):
    agent = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=2, max_new_tokens=4,
                 device="cpu", gamma=0.5, env="pick-two")
    try:
        assert agent.act(0) is not None
        agent.assign_reward(0.0)
        first_turn = agent._turns.encoded
        agent.act(1)
        assert agent._turns.reused >= first_turn  # the second turn did not encode the first again
        agent.assign_reward(0.5)
        agent.assign_reward(0.5)  # rewards of one step add up
        assert agent.terminate_episode() is None
        agent.act(0)
        agent.act(1)
        agent.assign_reward(-1.0)
        stats = agent.terminate_episode()
    finally:
        agent.close()
    assert stats is not None and stats["episodes"] == 2 and stats["turns"] == 4
    assert stats["version"] == "v0001" and stats["promoted"] and agent.registry.current() == "v0001"
    assert stats["mean_return"] == pytest.approx(0.0)  # (0 + 1 + 0 - 1) / 2 episodes

    store = Store(agent.cfg.db_url)
    pairs = store.rated_pairs(agent.slug, all_states=True)
    with store.session() as s:
        steps = s.query(CaptureRow).filter(CaptureRow.source == "gym").count()
    assert 1 <= steps <= 4 and len(pairs) == steps  # a blank answer trains, but no capture holds it
    for rating, cap in pairs:
        assert (cap.source, cap.owner, rating.source, rating.actor) == ("gym", "pick-two", "gym", "pick-two")
        assert cap.behaviour_logprobs and cap.conversation.startswith("pick-two/")
        assert rating.run_id is not None  # consumed by the agent's run, never trained again by a worker
    comments = sorted(r.comment for r, _ in pairs)
    # the first episode's returns with gamma 0.5: 0 + 0.5 * 1 = 0.5 and 1; the second's: -0.5 and -1
    assert set(comments) <= {"pick-two: reward 0, return 0.5 (step 1 of 2)",
                             "pick-two: reward 1, return 1 (step 2 of 2)",
                             "pick-two: reward 0, return -0.5 (step 1 of 2)",
                             "pick-two: reward -1, return -1 (step 2 of 2)"}

    monkeypatch.setenv("RLFLEET_HOME", str(queued_home))
    status = json.loads(runner.invoke(app, ["status", "--json"], catch_exceptions=False).output)
    assert status["ratings"]["total"] == steps and status["ratings"]["pending"] == 0
    assert status["adapter"]["current"] == "v0001"
    history = runner.invoke(app, ["history", "--json"], catch_exceptions=False)
    assert history.exit_code == 0 and "v0001" in history.output
    out = tmp_path / "ratings.jsonl"
    assert runner.invoke(app, ["export", "ratings", str(out)], catch_exceptions=False).exit_code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == steps and all(r["rlfleet"]["source"] == "gym" for r in rows)
    # the reward in its own field, the step's own (not its return): each comment says the same number
    assert all(f"reward {r['reward']:g}," in r["comment"] for r in rows)
    assert {r["reward"] for r in rows} <= {0.0, 1.0, -1.0}
    # a backup brings the rewards back into a fresh data dir, where no chat run would train on them
    fresh = tmp_path / "restored"
    monkeypatch.setenv("RLFLEET_HOME", str(fresh))
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    assert runner.invoke(app, ["import", "ratings", str(out)], catch_exceptions=False).exit_code == 0
    restored = Store(f"sqlite:///{fresh / 'rlfleet.db'}")
    assert sorted(r.reward for r, _ in restored.rated_pairs(all_states=True)) == sorted(r["reward"] for r in rows)


def test_a_stopped_agents_episodes_train_in_the_next_agents_first_batch_never_as_chat_ratings(
        queued_home, tiny_model_dir, single_thread, monkeypatch):
    def play(agent: Agent, rewards: list[float]) -> dict | None:
        for r in rewards:
            agent.act(len(r.hex()))
            agent.assign_reward(r)
        return agent.terminate_episode()

    first = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=3, max_new_tokens=4,
                 device="cpu", gamma=0.5, env="pick-resume")
    try:
        assert first.resumed_episodes == 0
        assert play(first, [0.0, 1.0]) is None and play(first, [-1.0, 0.0, 2.0]) is None
    finally:
        first.close()  # stopped with 2 of 3 episodes: no run
    store = Store(first.cfg.db_url)
    stored = store.untrained_steps(first.slug, "pick-resume")
    assert stored and all(r.run_id is None and r.reward in (0.0, 1.0, -1.0, 2.0) for r, _ in stored)
    assert store.pending_count(first.slug) == 0  # the chat trigger's count: nothing of people's to train
    assert store.pending_ratings(first.slug, 100) == []
    monkeypatch.setenv("RLFLEET_HOME", str(queued_home))
    monkeypatch.setenv("RLFLEET_MODEL", str(tiny_model_dir))
    said = runner.invoke(app, ["train", "--wait"], catch_exceptions=False).output
    assert "nothing to train on" in said, said
    assert [r.id for r, _ in store.untrained_steps(first.slug, "pick-resume")] == [r.id for r, _ in stored]

    other = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=3, device="cpu", env="another")
    assert other.resumed_episodes == 0  # another environment's episodes are not its
    other.close()
    again = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=3, max_new_tokens=4,
                 device="cpu", gamma=0.5, env="pick-resume")
    try:
        episodes = {c.conversation for _, c in stored}
        assert again.resumed_episodes == len(episodes)
        for episode in again._batch:  # as played: steps in order, their returns discounted again
            rewards = [s.reward for s in episode.steps]
            assert rewards in ([0.0, 1.0], [-1.0, 0.0, 2.0]) or len(rewards) < 3
            assert episode.returns == discounted_returns(rewards, 0.5)
        stats = play(again, [1.0]) if len(episodes) == 2 else (play(again, [1.0]) or play(again, [1.0]))
    finally:
        again.close()
    assert stats is not None and stats["episodes"] == 3 and stats["version"] == "v0001"
    assert store.untrained_steps(first.slug, "pick-resume") == []  # every stored step trained, once


def test_misuse_says_what_went_wrong_and_loses_nothing(queued_home, tiny_model_dir, single_thread):
    agent = Crashing(model=str(tiny_model_dir), home=queued_home, episodes_per_update=4, max_new_tokens=4,
                     device="cpu", env="crashy")
    try:
        with pytest.raises(GymError, match=r"terminate_episode\(\) with no act\(\)"):
            agent.terminate_episode()
        with pytest.raises(GymError, match=r"assign_reward\(1.0\) before any act\(\)"):
            agent.assign_reward(1.0)
        with pytest.raises(GymError, match=r"Crashing\.extract_action failed .*ValueError: no move in that.*"
                                           r"the step is kept"):
            agent.act("x")
        agent.assign_reward(2.0)  # the step was kept: it takes its reward
        with pytest.raises(GymError, match="a reward must be finite"):
            agent.assign_reward(float("nan"))
        for bad in ("1.5", True, None, [1]):  # a number, as the docs say: no coercion of text or flags
            with pytest.raises(GymError, match="a reward is a number"):
                agent.assign_reward(bad)
        assert agent.terminate_episode() is None
        with pytest.raises(GymError, match="no act"):
            agent.terminate_episode()  # closed already: a second close is refused, the first is kept
    finally:
        agent.close()
    with pytest.raises(GymError, match="engine 'vllm' is not one of auto, torch, llama.cpp"):
        Crashing(model=str(tiny_model_dir), home=queued_home, engine="vllm")
    for kw, words in [({"episodes_per_update": "4"}, "episodes_per_update is a whole number of at least 1, not '4'"),
                      ({"gamma": "0.9"}, "gamma is a number in [0, 1], not '0.9'"),
                      ({"episodes_per_update": 1}, "with one episode per update the batch baseline"),
                      ({"stepz": 1}, "bad training setting: stepz: extra inputs"),
                      ({"lr": 5}, "bad training setting: lr"),
                      ({"home": ""}, "home is empty"),
                      ({"home": str(queued_home / "config.toml" / "x")}, "is a file, not a folder")]:
        with pytest.raises(GymError) as exc:  # one line, before anything is loaded or written
            Crashing(**{"model": str(tiny_model_dir), "home": queued_home, **kw})
        assert words.lower() in str(exc.value).lower() and "\n" not in str(exc.value), (kw, str(exc.value))
    with pytest.raises(GymError, match="answer_prefix is text, not 5"):
        Crashing(model=str(tiny_model_dir), home=queued_home, answer_prefix=5)

    class NoText(Pick):
        def get_answer_prefix(self):
            return None

    odd = NoText(model=str(tiny_model_dir), home=queued_home, max_new_tokens=2, device="cpu", env="no-text")
    try:
        with pytest.raises(GymError, match=r"NoText\.get_answer_prefix returned None: it must return text"):
            odd.act(0)
        assert not odd._episode.steps  # nothing was answered or recorded
    finally:
        odd.close()
    pairs = Store(agent.cfg.db_url).rated_pairs(agent.slug)
    blank = not pairs  # the tiny model's answer may be blank: the step then trains unstored
    assert blank or (len(pairs) == 1 and pairs[0][0].value == 1 and "reward 2, return 2" in pairs[0][0].comment
                     and "extract_action failed: ValueError: no move in that" in pairs[0][0].comment)


def test_rewards_that_would_add_up_past_a_float_are_refused_and_the_episode_still_closes(queued_home,
                                                                                       tiny_model_dir,
                                                                                       monkeypatch):
    import rlfleet.gym.agent as agent_module
    from rlfleet.shared.queue import inline_holder, train_lock_key

    agent = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=2, max_new_tokens=2,
                 device="cpu", env="overflow", gamma=1.0, steps=1)
    try:
        agent.act(0)
        agent.assign_reward(1e308)
        agent.act(1)
        with pytest.raises(GymError, match="add up past a float"):  # each finite; the return would not be
            agent.assign_reward(1e308)
        assert [s.reward for s in agent._episode.steps] == [1e308, 0.0]  # nothing was recorded
        agent.assign_reward(1.0)
        assert agent.terminate_episode() is None  # stored: its returns are finite
        assert agent._batch[-1].returns == [1e308 + 1.0, 1.0]
        # The batch trains in this process: it holds the training lock as itself meanwhile (else
        # `status` and a worker starting here would call the run dead), and lets go after.
        held, real = [], agent_module.train_candidate
        monkeypatch.setattr(agent_module, "train_candidate", lambda *a, **k: (
            held.append(agent._redis().get(train_lock_key(agent.slug))), real(*a, **k))[1])
        agent.act(2)
        agent.assign_reward(-1.0)
        assert agent.terminate_episode() is not None
        assert held == [inline_holder().encode()] and not agent._redis().exists(train_lock_key(agent.slug))
    finally:
        agent.close()


def test_a_run_stopped_with_its_process_says_so_in_words():
    from rlfleet.gym.agent import _stopped_by

    assert _stopped_by(KeyboardInterrupt()).startswith("stopped: the agent's process was interrupted")
    assert "exited (status 143)" in _stopped_by(SystemExit(143))  # a kill at Python's default
    assert _stopped_by(RuntimeError("out of memory")) == "RuntimeError: out of memory"
    assert _stopped_by(RuntimeError()) == "RuntimeError"  # not "RuntimeError: "


def test_discounted_returns_and_the_batch_baseline_per_step():
    assert discounted_returns([0.0, 0.0, 1.0], 0.5) == [0.25, 0.5, 1.0]
    assert discounted_returns([1.0, 1.0], 1.0) == [2.0, 1.0]
    a, b = Episode("a", returns=[1.0, 2.0]), Episode("b", returns=[3.0])
    assert step_baselines([a, b]) == [2.0, 2.0]


def test_a_return_is_measured_against_its_own_baseline_in_the_same_advantage_rule():
    from rlfleet.worker.samples import TrainSample
    from rlfleet.worker.training.advantages import run_advantages

    rated = TrainSample(1, [{"role": "user", "content": "q"}], "a", 1.0)
    step_up = TrainSample(2, [{"role": "user", "content": "q"}], "a", 0.5, baseline=0.25)
    step_down = TrainSample(3, [{"role": "user", "content": "q"}], "a", 0.5, baseline=0.75)
    far = TrainSample(4, [{"role": "user", "content": "q"}], "a", 9.0, baseline=0.0)
    assert run_advantages([rated, step_up, step_down, far], 0.5, 1.2, 2.0) == pytest.approx([0.6, 0.3, -0.25, 2.0])
    # the asymmetric rule's mean is over the ratings alone: the steps bring their own baseline
    assert run_advantages([rated, step_up], None, 1.2, 2.0, rule="asymmetric") == \
        run_advantages([rated], None, 1.2, 2.0, rule="asymmetric") + [pytest.approx(0.3)]


class PickEnv:
    """A one-step environment (Gymnasium's reset/step shapes) that pays 1 for the action ``pays``."""

    def __init__(self, pays: str) -> None:
        self.pays = pays

    def reset(self, seed=None):
        return (seed or 0) % 7, {}

    def step(self, action):
        return 0, float(action == self.pays), True, False, {}


def test_the_returns_gate_refuses_only_a_candidate_worse_beyond_noise():
    same = judge_returns([1, 0, 1, 0], [1, 0, 1, 0])
    assert same.ok and same.diff == 0 and same.half_width == 0
    worse = judge_returns([1.0] * 8, [0.0] * 8)  # worse on every episode: no noise to hide in
    assert not worse.ok and "worse beyond noise" in worse.reason and worse.diff == -1
    noisy = judge_returns([1, 0, 1, 0, 1, 0], [0, 1, 0, 0, 1, 0])  # a coin's worth worse
    assert noisy.ok and noisy.diff < 0 < noisy.diff + noisy.half_width
    assert judge_returns([0, 0], [1, 1]).ok
    with pytest.raises(ValueError, match="paired"):
        judge_returns([1.0], [0.0])


class CountDown:
    """A Gymnasium-style environment: the seed sets how many steps the episode lasts; "up" pays 1."""

    def reset(self, seed: int) -> tuple[int, dict]:
        self.left = seed % 4 + 1
        return self.left, {}

    def step(self, action: str) -> tuple[int, float, bool, bool, dict]:
        self.left -= 1
        return self.left, float(action == "up"), self.left == 0, False, {}


def test_held_out_episodes_play_in_lockstep_one_batched_call_a_turn():
    calls: list[tuple[int, int]] = []  # (live episodes, turn seed) of each call

    def respond(prompts: list[list[dict]], seed: int) -> list[str]:
        calls.append((len(prompts), seed))
        # The episode's own conversation comes back: the answer depends on how far it has gone.
        return ["down" if len(p) >= 5 else "up" for p in prompts]

    def prompt(conversation: list[dict], observation: int) -> list[dict]:
        so_far = conversation or [{"role": "system", "content": "count"}]
        return [*so_far, {"role": "user", "content": str(observation)}]

    actions: list[tuple[str, int]] = []
    seeds = [0, 1, 2, 3, 4, 7]  # episodes of 1, 2, 3, 4, 1 and 4 steps
    returns = play_lockstep([CountDown() for _ in range(4)], seeds, respond, prompt, str, 10,
                            on_action=lambda action, observation: actions.append((action, observation)))
    # Two "up"s pay, then the conversation is long enough to answer "down".
    assert returns == [1.0, 2.0, 2.0, 2.0, 1.0, 2.0]
    # Chunk 1 (seeds 0-3): 4 live, then 3, 2, 1; chunk 2 (seeds 4, 7): 2, then 1, 1, 1. One call a turn.
    assert [n for n, _ in calls] == [4, 3, 2, 1, 2, 1, 1, 1]
    assert [s for _, s in calls] == [0, 1, 2, 3, 4 * 7_919, 4 * 7_919 + 1, 4 * 7_919 + 2, 4 * 7_919 + 3]
    assert len(actions) == sum(seed % 4 + 1 for seed in seeds)
    assert all(isinstance(observation, int) for _, observation in actions)  # each with what it answered

    def unreadable(text: str) -> str:
        if text == "down":
            raise ValueError("no action in that")
        return text

    # An answer that names no action ends its episode with what it has.
    assert play_lockstep([CountDown()], [3], respond, prompt, unreadable, 10) == [2.0]
    assert play_lockstep([CountDown()], [3], respond, prompt, str, 1) == [1.0]  # the step cap
    with pytest.raises(ValueError, match="no environments"):
        play_lockstep([], [1], respond, prompt, str, 10)


def test_held_out_episodes_refuse_a_candidate_that_plays_worse_and_serve_one_that_plays_better(
        queued_home, peaked_model_dir, single_thread):
    """The training episodes pay B, the held-out environment pays A: the run learns B and is refused on
    the held-out episodes; trained to A it is served. The base plays the held-out episodes once."""
    agent = Pick(model=str(peaked_model_dir), home=queued_home, episodes_per_update=16, max_new_tokens=1,
                 device="cpu", preset="aggressive", lr=1e-2, steps=40, heldout_env=lambda: PickEnv("A"),
                 heldout_episodes=512)

    def one_run(paying: str) -> dict:
        stats = None
        for episode in range(16):
            agent.assign_reward(float(agent.act(episode % 7) == paying))
            stats = agent.terminate_episode()
        assert stats is not None
        return stats

    try:
        base = list(agent.heldout_returns(None))
        taught_b = one_run("B")
        taught_a = one_run("A")
    finally:
        agent.close()
    assert "heldout" in taught_b, {k: taught_b[k] for k in ("message", "reason", "promoted", "mean_kl")}
    assert taught_b["heldout"]["parent_mean"] == pytest.approx(sum(base) / len(base))
    assert taught_b["heldout"]["diff"] < 0 and not taught_b["promoted"], taught_b["heldout"]
    assert "worse beyond noise" in taught_b["message"]
    assert taught_a["promoted"] and taught_a["heldout"]["diff"] > 0, taught_a
    h = taught_a["heldout"]
    assert taught_a["message"] == (f"v0002 is live (trained on 16 turns of 16 episodes, held-out mean return "
                                   f"{h['candidate_mean']:.3g} against {h['parent_mean']:.3g} on the same 512 "
                                   "episodes)")
    assert agent.registry.current() == taught_a["version"] == "v0002"
    served = Store(agent.cfg.db_url).get_run(taught_a["run_id"])
    assert served.metrics["heldout_returns"]["candidate_mean"] == taught_a["heldout"]["candidate_mean"]


def test_in_the_background_the_loop_keeps_acting_while_a_run_trains_and_a_failed_run_is_raised_in_it(
        queued_home, tiny_model_dir, single_thread, monkeypatch):
    agent = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=2, max_new_tokens=4,
                 device="cpu", env="pick-bg", background=True, steps=4)
    acted_while_training, handed_out = 0, []
    assert agent._workers is not None  # no training worker listened on the queue: the agent started one
    children = [agent._workers.proc]
    assert agent.worker_pid == children[0].pid  # what bench.gym reads the worker's memory by
    try:
        for episode in range(6):
            agent.act(episode)
            acted_while_training += agent._runner is not None and agent._runner.is_alive()
            agent.assign_reward(float(episode % 2))
            stats = agent.terminate_episode()
            if stats is not None:
                handed_out.append(stats)
        rest = agent.wait()

        def broken(batch):
            raise RuntimeError("out of memory")

        monkeypatch.setattr(agent, "train", broken)
        for episode in range(2):
            agent.act(episode)
            agent.assign_reward(1.0)
            agent.terminate_episode()
        with pytest.raises(GymError, match=r"background training run failed \(RuntimeError: out of memory\)"):
            agent.wait()
        for episode in range(2):  # again, and close() is the next call: it raises it, after closing
            agent.act(episode)
            agent.assign_reward(1.0)
            agent.terminate_episode()
        with pytest.raises(GymError, match=r"background training run failed \(RuntimeError: out of memory\)"):
            agent.close()
    finally:
        agent.close()
    runs = handed_out + rest
    assert children and all(p.poll() is not None for p in children)  # close() stopped the worker it started
    assert all(r["trained_by_pid"] not in (None, os.getpid()) for r in runs)  # trained in the worker process
    assert acted_while_training >= 1  # the loop went on while a run trained
    assert len(runs) == 3 and [r["run_id"] for r in runs] == sorted(r["run_id"] for r in runs)  # each once, in order
    assert all(r["episodes"] == 2 for r in runs)
    versions = [r["version"] for r in runs if r["promoted"]]
    assert versions and agent.registry.current() == max(versions)
    store = Store(agent.cfg.db_url)
    with store.session() as s:
        assert s.query(CaptureRow).filter(CaptureRow.source == "gym").count() >= 4  # the failed batch's too


def test_a_training_worker_killed_mid_run_is_raised_in_the_loop_and_the_next_batch_trains(
        queued_home, tiny_model_dir, single_thread):
    """SIGKILL the worker the agent started while it trains: the run fails with the reason, its episodes
    stay stored, the worker is started again and the next batch trains and is served."""
    import signal
    import time

    from rq.job import Job, JobStatus

    from rlfleet.shared.job_names import train_job_id
    from rlfleet.shared.queue import progress_key

    agent = Pick(model=str(tiny_model_dir), home=queued_home, episodes_per_update=2, max_new_tokens=4,
                 device="cpu", env="pick-kill", background=True, steps=24)
    try:
        for episode in range(2):
            agent.act(episode)
            agent.assign_reward(float(episode % 2))
            agent.terminate_episode()
        conn = agent._redis()
        deadline = time.monotonic() + 120
        while agent.store.latest_run(agent.slug) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        run_id = agent.store.latest_run(agent.slug).id
        job_id = train_job_id(agent.slug, run_id)
        while not Job.exists(job_id, connection=conn) and time.monotonic() < deadline:
            time.sleep(0.05)  # the run is stored a moment before its job is queued
        job = Job.fetch(job_id, connection=conn)
        while int(conn.hget(progress_key(agent.slug), "step") or 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the worker is inside the run's updates
        assert job.get_status(refresh=True) == JobStatus.STARTED
        agent._workers.proc.send_signal(signal.SIGKILL)
        with pytest.raises(GymError, match=r"background training run failed .*training worker failed on run"):
            agent.wait()
        for episode in range(2):
            agent.act(episode)
            agent.assign_reward(float(episode % 2))
            agent.terminate_episode()
        runs = agent.wait()
    finally:
        agent.close()
    assert len(runs) == 1 and runs[0]["promoted"], runs
    assert agent.registry.current() == runs[0]["version"]
    assert agent.store.get_run(run_id).state == "failed"
    with Store(agent.cfg.db_url).session() as s:
        assert s.query(CaptureRow).filter(CaptureRow.source == "gym").count() == 4  # the killed run's too


def test_a_run_crosses_to_the_worker_and_back_as_plain_data(home):
    """What the agent enqueues and what the worker hands back: samples and config as JSON, the
    candidate (its integer-keyed advantages included) as the job's result; a batch with nothing to learn
    comes back as NothingToLearn."""
    from rlfleet.shared.config import load_config
    from rlfleet.shared.job_result import JobResult
    from rlfleet.worker.agent_runs import GymRunRequest, candidate_result
    from rlfleet.worker.orchestrate import Candidate
    from rlfleet.worker.samples import TrainSample
    from rlfleet.worker.training.loop import NothingToLearn

    cfg = load_config(home).model_copy(update={"train": load_config(home).train.model_copy(update={"steps": 7})})
    sample = TrainSample(rating_id=3, prompt=[{"role": "user", "content": "A or B?"}], response="A", reward=0.5,
                         behaviour_logprobs=[-0.1], behaviour_token_ids=[65], baseline=0.25)
    wire = GymRunRequest.of(cfg, 12, "v0001", [sample]).model_dump_json()
    req = GymRunRequest.model_validate_json(wire)
    assert TrainSample(**req.samples[0]) == sample and req.run_id == 12 and req.parent == "v0001"
    assert type(cfg).model_validate(req.config).train.steps == 7
    c = Candidate(version="v0002", parent="v0001", metrics={"loss": 0.1}, advantages={3: 0.25}, new_ema=0.1,
                  promote=True, reason=None)
    from dataclasses import asdict

    assert candidate_result(JobResult.done("trained", candidate=asdict(c), pid=1).to_dict()) == c
    assert candidate_result({**JobResult.done("x", candidate=asdict(c)).to_dict(),
                             "candidate": {**asdict(c), "advantages": {"3": 0.25}}}) == c  # JSON's string keys
    with pytest.raises(NothingToLearn, match="every advantage is 0"):
        candidate_result(JobResult.failed("every advantage is 0", skipped=True).to_dict())


# A user's script, as LlamaGym's README has one: the agent on the embedded default (no REDIS_URL),
# training in the background worker, then killed mid-play by a `kill` it never prepared for.
KILLED_SCRIPT = r"""
import sys, time
sys.path.insert(0, sys.argv[3])
from test_gym import Pick
agent = Pick(model=sys.argv[1], home=sys.argv[2], episodes_per_update=2, max_new_tokens=4, device="cpu",
             env="pick-killed", background=True, steps=int(sys.argv[4]))
for episode in range(4):
    agent.act(episode)
    agent.assign_reward(1.0)
    agent.terminate_episode()
print("worker", agent.worker_pid, flush=True)
agent.act(99)  # an episode in hand, never terminated
time.sleep(120)
"""


def test_a_killed_script_leaves_no_redis_or_worker_running_and_keeps_its_episodes(home, tiny_model_dir,
                                                                                 tmp_path):
    """SIGTERM to a script that never said what a kill does, while its worker trains: it exits (status
    143), its training worker stops with it there and then (the run in hand could not be concluded
    without the script, which plays the gate), the embedded Redis too, and the episodes it ended are
    stored."""
    from rlfleet.shared.embedded_redis import EmbeddedRedis, pid_alive

    data = tmp_path / "agent-home"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(tiny_model_dir), str(data),
                             os.path.dirname(__file__), "5000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    worker = server = None
    store = Store(f"sqlite:///{data / 'rlfleet.db'}")
    try:
        line = proc.stdout.readline()
        assert line.startswith("worker "), line + proc.stderr.read()
        worker = int(line.split()[1])
        server = EmbeddedRedis(data)._server_pid()
        assert server and pid_alive(server) and pid_alive(worker)
        deadline = time.monotonic() + 90
        while not ((run := store.latest_run(model_slug(str(tiny_model_dir)))) and run.state == "running"):
            assert time.monotonic() < deadline and proc.poll() is None, "no run started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM, proc.stderr.read()
        deadline = time.monotonic() + 3  # (a worker left to its parent watch would train on for minutes)
        while (pid_alive(server) or pid_alive(worker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(worker), "the training worker outlived the script"
        assert not pid_alive(server) and not EmbeddedRedis.running(data), "the embedded Redis outlived the script"
    finally:  # a failure leaves nothing running either
        if proc.poll() is None:
            proc.kill()
        for pid in (worker, server):
            if pid and pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    with store.session() as s:
        assert s.query(CaptureRow).filter(CaptureRow.source == "gym").count() == 4  # the four ended episodes
    store.close()
