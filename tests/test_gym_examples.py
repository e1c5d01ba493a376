"""rlfleet.gym's shipped examples: the text game's rules, both agents' parsers, and the guessing game
played and trained end to end on the tiny model through the example's own command line."""

from __future__ import annotations

import gymnasium as gym
import pytest

from rlfleet.gym.examples import blackjack, guess
from rlfleet.gym.examples.guess import GuessNumberEnv
from rlfleet.shared.config import load_config
from rlfleet.shared.models import model_slug
from rlfleet.shared.schema import CaptureRow
from rlfleet.shared.store import Store


def test_the_guessing_game_says_higher_or_lower_and_pays_only_the_guess_that_finds_it():
    env = GuessNumberEnv(high=8, tries=3)
    first, _ = env.reset(seed=7)
    assert first.startswith("I am thinking of a whole number from 1 to 8. You have 3 guesses.")
    secret = env._secret
    low = 1 if secret > 1 else None
    if low is not None:
        said, reward, done, _, _ = env.step(low)
        assert (said, reward, done) == ("1 is too low. 2 guesses left. Your guess?", 0.0, False)
    else:
        env.step(8)
    said, reward, done, truncated, info = env.step(secret)
    assert (reward, done, truncated, info["secret"]) == (1.0, True, False, secret) and str(secret) in said
    with pytest.raises(RuntimeError, match="reset"):
        env.step(1)
    assert env.reset(seed=7)[0] == first and env._secret == secret  # a seed deals the same secret


def test_a_guess_that_is_no_number_in_range_costs_a_try_and_a_tenth_and_the_last_miss_reveals_the_secret():
    env = GuessNumberEnv(high=4, tries=2)
    env.reset(seed=0)
    said, reward, done, _, _ = env.step(0)
    assert said == "That is not a number from 1 to 4. 1 guess left. Your guess?" and reward == -0.1 and not done
    wrong = 1 if env._secret != 1 else 2
    said, reward, done, _, _ = env.step(wrong)
    assert done and reward == 0 and said.endswith(f"No guesses left: it was {env._secret}.")
    with pytest.raises(ValueError):
        GuessNumberEnv(high=1)


def test_the_game_is_registered_with_gymnasium_and_its_observations_are_in_its_space():
    env = gym.make(guess.ENV_ID)
    observation, _ = env.reset(seed=3)
    assert env.observation_space.contains(observation)
    observation, *_ = env.step(0)
    assert env.observation_space.contains(observation)


def test_the_example_agents_read_their_actions():
    read = guess.GuessAgent.extract_action
    assert [read(None, t) for t in ("5", "I guess 7, then 3.", "no idea", "")] == [5, 7, 0, 0]  # type: ignore[arg-type]
    bj = blackjack.BlackjackAgent.extract_action
    assert [bj(None, t) for t in ("Action: 1", "Action:0", "I hit.", "Action: 2, hit", "stay", "Action: 17, hit",
                                  "Action: 18")] == [1, 0, 1, 1, 0, 1, 0]  # type: ignore[arg-type]


def test_the_guessing_example_plays_trains_gates_and_serves_from_its_command_line(
        queued_home, tiny_model_dir, single_thread, capsys):
    totals = guess.main(["--model", str(tiny_model_dir), "--home", str(queued_home), "--episodes", "4",
                         "--per-update", "2", "--heldout", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert len(totals) == 4 and all(-0.4 - 1e-9 <= t <= 1.0 for t in totals)
    assert out.count("run ") == 2 and f"data dir: {queued_home}" in err
    said = [line for line in out.splitlines() if line.startswith("run ")]
    for line in said:  # each run served, refused, or said why there was nothing to learn, in an agent's words
        assert (" is live (trained on " in line or " was not promoted: " in line
                or "none returned more than its baseline (the batch's mean return at its step)" in line), line
    if any(" is live " in line for line in said):
        assert "held-out mean return on 2 episodes: v000" in out
    assert "mean return: first 2 episodes" in out
    cfg = load_config(queued_home)
    store = Store(cfg.db_url)
    runs = store.recent_runs(model_slug(cfg.model), 10)
    states = [r.state for r in runs]
    assert len(states) == 2 and all(state in ("succeeded", "rejected", "skipped") for state in states), states
    with store.session() as s:
        actors = {c.owner for c in s.query(CaptureRow).filter(CaptureRow.source == "gym")}
    assert actors == {"GuessNumber-v0"}


@pytest.mark.parametrize("example", [blackjack, guess], ids=["blackjack", "guess"])
def test_an_unknown_model_is_a_one_line_error_and_makes_no_data_dir(example, tmp_path, capsys):
    home = tmp_path / "home"
    with pytest.raises(SystemExit) as exit_:
        example.main(["--model", str(tmp_path / "no-such-model"), "--home", str(home)])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: model path ") and "Traceback" not in err
    assert not home.exists()
