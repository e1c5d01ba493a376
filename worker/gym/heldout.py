"""The environment's gate: a candidate version plays the same held-out episodes as its parent (the
same environment seeds, the same sampling seeds), and is promoted unless its mean return is worse
than the parent's beyond noise.

Paired episodes make the comparison tight: where both versions would act alike, their returns are
alike, and the difference's spread is what is left. ``judge_returns`` is the rule (pure);
``play_lockstep`` plays episodes of any Gymnasium-style environment (``reset(seed=)`` and a
five-tuple ``step``) without recording anything, many at once: every live episode's next turn is
answered in one batched call, which a CPU does for the cost of a few answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Z95 = 1.96


@dataclass(frozen=True)
class ReturnsVerdict:
    """How a candidate's held-out returns compare with its parent's on the same episodes."""

    ok: bool
    episodes: int
    parent_mean: float
    candidate_mean: float
    diff: float  # candidate minus parent, the mean of the paired differences
    half_width: float  # the 95 % interval's half width of ``diff``
    reason: str | None  # why it was refused

    def as_dict(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "parent_mean": self.parent_mean, "candidate_mean": self.candidate_mean,
                "diff": self.diff, "half_width": self.half_width, "ok": self.ok}


def mean_half_width(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    """The mean and its normal-approximation interval's half width, ``z * sd / sqrt(n)`` (0 for one value)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return mean, 0.0
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, z * sd / math.sqrt(n)


def judge_returns(parent: Sequence[float], candidate: Sequence[float], z: float = Z95) -> ReturnsVerdict:
    """Refuse the candidate only when its paired mean difference is below zero beyond the interval:
    ``diff + z * sd / sqrt(n) < 0``."""
    if len(parent) != len(candidate) or len(parent) < 2:
        raise ValueError(f"paired returns needed, at least two episodes each: got {len(parent)} and {len(candidate)}")
    n = len(parent)
    mean, half = mean_half_width([c - p for p, c in zip(parent, candidate, strict=True)], z)
    p_mean, c_mean = sum(parent) / n, sum(candidate) / n
    ok = mean + half >= 0.0
    reason = None if ok else (f"held-out mean return {c_mean:.3g} against the parent's {p_mean:.3g} on the same "
                              f"{n} episodes: {mean:+.3g} ± {half:.3g}, worse beyond noise")
    return ReturnsVerdict(ok, n, p_mean, c_mean, mean, half, reason)


Respond = Callable[[list[list[dict]], int], list[str]]
Prompt = Callable[[list[dict], Any], list[dict]]


def play_lockstep(envs: Sequence[Any], seeds: Sequence[int], respond: Respond, prompt: Prompt,
                  extract: Callable[[str], Any], max_steps: int,
                  on_action: Callable[[Any, Any], None] | None = None) -> list[float]:
    """The total reward of one episode per seed (``env.reset(seed=seed)``), ``len(envs)`` episodes in
    lockstep: at each turn ``respond(prompts, turn_seed)`` answers every live episode's prompt (its
    conversation so far and the observation, as ``prompt(conversation, observation)`` builds it) in one
    call. ``turn_seed`` depends on the chunk of episodes and the turn only, so two versions playing the
    same seeds draw alike. An answer ``extract`` cannot read ends its episode with what it has;
    ``on_action(action, observation)`` sees every action taken and the observation it answered. The
    envs are reused from chunk to chunk (reset re-seeds)."""
    if not envs:
        raise ValueError("no environments to play in")
    returns = [0.0] * len(seeds)
    for start in range(0, len(seeds), len(envs)):
        live = list(range(start, min(start + len(envs), len(seeds))))
        env_of = {i: envs[i - start] for i in live}
        obs = {i: env_of[i].reset(seed=seeds[i])[0] for i in live}
        conversations: dict[int, list[dict]] = {i: [] for i in live}
        for turn in range(max_steps):
            if not live:
                break
            prompts = [prompt(conversations[i], obs[i]) for i in live]
            texts = respond(prompts, start * 7_919 + turn)
            still = []
            for i, asked, text in zip(live, prompts, texts, strict=True):
                conversations[i] = [*asked, {"role": "assistant", "content": text}]
                try:
                    action = extract(text)
                except Exception:  # an unreadable answer ends the episode with what it has
                    continue
                if on_action is not None:
                    on_action(action, obs[i])
                obs[i], reward, terminated, truncated, _info = env_of[i].step(action)
                returns[i] += float(reward)
                if not (terminated or truncated):
                    still.append(i)
            live = still
    return returns
