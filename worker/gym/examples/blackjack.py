"""Gymnasium's Blackjack-v1 played by an rlfleet agent that learns from the hands' rewards.

    python -m rlfleet.gym.examples.blackjack --episodes 200 [--heldout 64] [--background]

Every answer starts with "Action:", written for the model (``answer_prefix``): on its own the default
model rarely keeps to the answer format, after the prefix it writes a digit almost every time.

Blackjack rewards luck as much as play: staying on every hand already wins about 40 % of them and the
best strategy about 43 %, so telling versions apart takes thousands of held-out hands
(bench/RESULTS.md, bench.gym).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..agent import Agent
from .play import main as play_main

ENV_ID = "Blackjack-v1"


class BlackjackAgent(Agent):
    def get_system_prompt(self) -> str:
        return ("You play blackjack. Each turn you see your sum, the dealer's card and whether you hold a usable "
                "ace. Reply 'Action: 1' to take another card or 'Action: 0' to stay.")

    def format_observation(self, observation: Any) -> str:
        total, dealer, ace = observation
        return f"Your sum is {total}, the dealer shows {dealer}, {'a' if ace else 'no'} usable ace. Action?"

    def extract_action(self, response: str) -> int:
        """1 (hit) for "Action: 1" or a "hit" without an action, else 0 (stay): Blackjack has no other.
        "Action: 17" (the model repeating its sum) is no action."""
        match = re.search(r"Action:\s*([01])\b", response)
        if match:
            return int(match.group(1))
        return 1 if re.search(r"\bhit\b", response, re.IGNORECASE) else 0


def make_env() -> Any:
    import gymnasium as gym

    return gym.make(ENV_ID)


def main(argv: Sequence[str] | None = None) -> list[float]:
    return play_main("python -m rlfleet.gym.examples.blackjack", __doc__, BlackjackAgent, make_env, argv,
                     env=ENV_ID, answer_prefix="Action:", max_new_tokens=4)


if __name__ == "__main__":
    main()
