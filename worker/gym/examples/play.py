"""The examples' episode loop and command line: play ``episodes`` episodes of an environment with an
agent, a progress bar over them, and one line per training run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlfleet.shared.errors import RlfleetError

from ..agent import Agent
from ..heldout import ReturnsVerdict, judge_returns


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=200, help="episodes to play (default 200)")
    ap.add_argument("--per-update", type=int, default=16, help="episodes per training run (default 16)")
    ap.add_argument("--model", default="smollm2-135m", help="alias, local folder or hub id (default smollm2-135m)")
    ap.add_argument("--home", type=Path, help="data dir (default: a fresh one under the user's data dir)")
    ap.add_argument("--heldout", type=int, default=0, metavar="N",
                    help="the environment's gate: each candidate plays N held-out episodes (default 0: off)")
    ap.add_argument("--background", action="store_true", help="train in the training worker while playing on")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | mps")
    ap.add_argument("--seed", type=int, default=0, help="episode i is dealt with env seed SEED + i (default 0)")
    return ap


def run_line(stats: dict) -> str:
    """One training run's outcome in a line."""
    if stats.get("skipped"):
        return f"run {stats['run_id']}: {stats['skipped']}"
    return f"run {stats['run_id']}: {stats['message']} · mean return of its episodes {stats['mean_return']:+.2f}"


def play(agent: Agent, make_env: Callable[[], Any], episodes: int, seed: int, quiet: bool = False) -> list[float]:
    """Play ``episodes`` episodes (episode i reset with seed ``seed + i``); each episode's total reward."""
    from tqdm import tqdm

    env = make_env()
    totals: list[float] = []
    bar = tqdm(range(episodes), desc="episodes", unit="ep", disable=quiet, file=sys.stderr)
    for episode in bar:
        observation, _ = env.reset(seed=seed + episode)
        done, total = False, 0.0
        while not done:
            observation, reward, terminated, truncated, _ = env.step(agent.act(observation))
            agent.assign_reward(float(reward))
            total += float(reward)
            done = terminated or truncated
        totals.append(total)
        stats = agent.terminate_episode()
        if stats is not None:
            bar.write(run_line(stats))
        recent = totals[-agent.episodes_per_update:]
        bar.set_postfix(served=agent.registry.current() or "base", mean_return=f"{sum(recent) / len(recent):+.2f}")
    for stats in agent.wait():
        bar.write(run_line(stats))
    return totals


def main(prog: str, doc: str | None, agent_class: type[Agent], make_env: Callable[[], Any],
         argv: Sequence[str] | None = None, **agent_kwargs: Any) -> list[float]:
    args = parser(prog, doc).parse_args(argv)
    if args.episodes < 1 or args.per_update < 1 or args.heldout == 1 or args.heldout < 0:
        sys.exit("error: --episodes and --per-update must be at least 1, --heldout 0 (off) or at least 2 (the "
                 "gate measures noise between held-out episodes)")
    try:
        return _main(args, agent_class, make_env, **agent_kwargs)
    except RlfleetError as exc:  # an unknown model, a bad setting, a misused agent: said in a line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


def _main(args: argparse.Namespace, agent_class: type[Agent], make_env: Callable[[], Any],
          **agent_kwargs: Any) -> list[float]:
    gate = {"heldout_env": make_env, "heldout_episodes": args.heldout} if args.heldout else {}
    agent = agent_class(model=args.model, home=args.home, episodes_per_update=args.per_update,
                        background=args.background, device=args.device, **gate, **agent_kwargs)
    print(f"data dir: {agent.home} (rlfleet --home {agent.home} status | history)", file=sys.stderr)
    try:
        totals = play(agent, make_env, args.episodes, args.seed)
        half = max(len(totals) // 2, 1)
        first, last = totals[:half], totals[-half:]
        served = agent.registry.current()
        print(f"mean return: first {len(first)} episodes {sum(first) / len(first):+.3f}, "
              f"last {len(last)} {sum(last) / len(last):+.3f}; served: {served or 'the base'}")
        if args.heldout and served is not None:
            print(heldout_line(judge_returns(agent.heldout_returns(None), agent.heldout_returns(served)), served))
    finally:
        agent.close()
    return totals


def heldout_line(v: ReturnsVerdict, served: str) -> str:
    """The served version against the base on the same held-out episodes."""
    return (f"held-out mean return on {v.episodes} episodes: {served} {v.candidate_mean:+.3f}, the base "
            f"{v.parent_mean:+.3f}; difference {v.diff:+.3f} ± {v.half_width:.3f} (95 %)")
