"""A small text game of our own: guess a secret whole number, told "higher" or "lower" after each miss.

    python -m rlfleet.gym.examples.guess --episodes 200 [--heldout 64] [--background]

``GuessNumberEnv`` is a Gymnasium environment whose observations are text (registered as
``rlfleet/GuessNumber-v0``): the secret is drawn from 1 to ``high`` at reset, an episode lasts at most
``tries`` guesses, and the reward is 1 on the guess that finds it, so with ``gamma`` below 1 an agent
learns to find it in fewer guesses. A reply that is no number from 1 to ``high`` (the agent's parser
found none) costs a try, is said so, and is rewarded ``-invalid_cost`` (0.1): the game's first lesson,
answering with a number at all, then has a signal on every turn instead of on the rare lucky find.
Unlike Blackjack its episodes have several turns: each turn's prompt holds the game so far, which the
agent's turn cache does not encode again.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
from gymnasium import spaces

from ..agent import Agent
from .play import main as play_main

ENV_ID = "rlfleet/GuessNumber-v0"


class GuessNumberEnv(gym.Env):
    """Observations are text; an action is the guessed number (anything else is a wasted try)."""

    metadata = {"render_modes": []}

    def __init__(self, high: int = 8, tries: int = 4, invalid_cost: float = 0.1) -> None:
        if high < 2 or tries < 1 or invalid_cost < 0:
            raise ValueError("high must be at least 2, tries at least 1 and invalid_cost at least 0")
        self.high, self.tries, self.invalid_cost = high, tries, float(invalid_cost)
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Discrete(high, start=1)
        self._secret = 0
        self._left = 0
        self._over = True  # until reset()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        self._secret = int(self.np_random.integers(1, self.high + 1))
        self._left, self._over = self.tries, False
        return (f"I am thinking of a whole number from 1 to {self.high}. You have {self.tries} guesses. "
                "Your guess?"), {}

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict]:
        if self._over:
            raise RuntimeError("the episode is over: call reset() first")
        self._left -= 1
        self._over = self._left == 0
        guess = int(action) if isinstance(action, (int, float)) or str(action).strip().isdigit() else 0
        if guess == self._secret:
            self._over = True
            return f"Yes, it was {self._secret}!", 1.0, True, False, {"secret": self._secret}
        reward = 0.0
        if not 1 <= guess <= self.high:
            said, reward = f"That is not a number from 1 to {self.high}.", -self.invalid_cost
        else:
            said = f"{guess} is too {'low' if guess < self._secret else 'high'}."
        if self._left == 0:
            return f"{said} No guesses left: it was {self._secret}.", reward, True, False, {"secret": self._secret}
        left = f"{self._left} guess{'es' if self._left > 1 else ''} left"
        return f"{said} {left}. Your guess?", reward, False, False, {}


class GuessAgent(Agent):
    def get_system_prompt(self) -> str:
        return "We play a guessing game. Reply with one number only: your guess."

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def extract_action(self, response: str) -> int:
        """The first whole number in the answer; 0 (a wasted try) when there is none."""
        match = re.search(r"\d+", response)
        return int(match.group()) if match else 0


def make_env() -> GuessNumberEnv:
    return GuessNumberEnv()


if ENV_ID not in gym.registry:
    gym.register(id=ENV_ID, entry_point="rlfleet.gym.examples.guess:GuessNumberEnv")


def main(argv: Sequence[str] | None = None) -> list[float]:
    return play_main("python -m rlfleet.gym.examples.guess", __doc__, GuessAgent, make_env, argv,
                     env="GuessNumber-v0", max_new_tokens=8, gamma=0.9)


if __name__ == "__main__":
    main()
