"""rlfleet.gym's two examples, each runnable as a module:

    python -m rlfleet.gym.examples.blackjack --episodes 200    # Gymnasium's Blackjack-v1
    python -m rlfleet.gym.examples.guess --episodes 200        # a small text game of our own

:mod:`.guess` also registers its environment with Gymnasium as ``rlfleet/GuessNumber-v0``.
"""
