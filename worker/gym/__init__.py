"""``rlfleet.gym``: an LLM agent that learns from an environment's reward, LlamaGym's ``Agent`` API on
rlfleet's trainer, versions and store (README, "Agents in an environment").

Installed as ``rlfleet.gym`` (pyproject's package-dir) and imported under that name only, as worker/cli/
is ``rlfleet.cli`` only: a file read under two names would be two modules.
"""

from .agent import Agent, GymError

__all__ = ["Agent", "GymError"]
