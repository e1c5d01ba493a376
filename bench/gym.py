"""rlfleet.gym's Agent against LlamaGym's own Blackjack example: same model, episodes, machine.

    python -m bench.gym --episodes 64 --block 16 --heldout 200 --threads 1
    python -m bench.gym --only ours --episodes 1000 --heldout 500      # ours alone (LlamaGym is slow)

Both sides play Blackjack-v1 with the agent of LlamaGym's example (its system prompt, observation text
and action parser verbatim: bench/gym_llamagym.py's ``BlackjackPrompts``), episode i dealt with env
seed SEED + i, each side in its own process, one after the other:

* ``ours``: ``rlfleet.gym.Agent`` on the default model (the GGUF, dequantised to fp32), a fresh data
  dir, training inline every ``--per-update`` episodes through the worker's run path (its defaults:
  preset balanced, temperature 1, top-p 1), answers capped at ``--max-new-tokens``.
* ``llamagym``: LlamaGym 0.1.1's example (bench/gym_llamagym.py) in its own virtual environment
  (``--llamagym-python``, default /work/llamagym-venv/bin/python; how to build it is in that file), on
  a safetensors copy of the same weights (transformers 4.38, which LlamaGym's trl needs, cannot read
  GGUF), trl's PPO with a value head and a full reference copy, batches of 8 turns, its own
  generation settings (temperature 0.9, top-p 0.6).

Figures: episodes/s over the episode loop (acting, stepping, storing and the inline training runs; the
model load is reported apart), peak resident memory of each side's process (VmHWM, load included; for
ours the embedded Redis server is a process of its own, a few MB, not counted), and their ratios (ours /
LlamaGym); with ``--background`` ours' peak adds the training worker's process. The learning curve: win
rate and mean return per block of ``--block`` episodes with 95 % intervals (Wilson for the rate, normal
for the mean). For ours, a held-out win rate on ``--heldout`` fixed env seeds never trained on (played
after the loop: not in the timing or the peak), by the served version and by the base, with the 95 %
interval of their paired difference (both play the same env seeds with the same sampling seeds):
"learns" means the win rate's interval lies above 0. If LlamaGym cannot run, its
error is printed and ours still reported.

LlamaGym's 1,000 episodes take hours on a CPU; ``--llamagym-state DIR`` plays them in parts: each
invocation resumes from the state saved in DIR, and with ``--llamagym-until S`` stops after S seconds of
playing with the state saved (the report then says how many episodes are played, and is not appended
to bench/RESULTS.md; the same command goes on). Its timings add up over the parts (each part's model
load is reported apart).

    python -m bench.gym --only llamagym --episodes 1000 --block 100 --threads 1 \
        --llamagym-state bench/gym_runs/llamagym-1000 --llamagym-until 7200      # again until finished
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .record import markdown_table, output_options, parser, publish

SIDES = ("ours", "llamagym")
ENV = "Blackjack-v1"
HELDOUT_SEED = 1_000_000  # held-out episode i is dealt with env seed HELDOUT_SEED + i: never a training seed
LLAMAGYM_PYTHON = "/work/llamagym-venv/bin/python"
ROOT = Path(__file__).resolve().parents[1]


# -- the figures: pure functions over episode returns ----------------------------------------------


SUM_BUCKETS = ("≤11", "12–16", "≥17")  # a hit never busts / depends on the dealer / mostly busts


def sum_bucket(player_sum: int) -> str:
    return SUM_BUCKETS[0] if player_sum <= 11 else SUM_BUCKETS[1] if player_sum <= 16 else SUM_BUCKETS[2]


def basic_strategy(observation: Sequence[int]) -> int:
    """Blackjack's textbook basic strategy for hit (1) or stay (0), without doubling or splitting."""
    total, dealer, ace = observation
    if ace:
        return int(total <= 17 or (total == 18 and dealer in (1, 9, 10)))
    if total <= 11:
        return 1
    if total == 12:
        return int(dealer in (1, 2, 3) or dealer >= 7)
    return int(total <= 16 and (dealer == 1 or dealer >= 7))


# Fixed policies played on the held-out deals beside the model: where "learns" stands against play
# that needs no model at all.
REFERENCE_POLICIES: dict[str, Any] = {
    "always stay": lambda obs: 0,
    "hit below 17": lambda obs: int(obs[0] < 17),
    "basic strategy": basic_strategy,
}


def reference_win_rates(seeds: Sequence[int]) -> dict[str, float]:
    """Each reference policy's win rate on the held-out deals (env seed per episode)."""
    import gymnasium as gym

    env = gym.make(ENV, natural=False, sab=False)
    out = {}
    for name, policy in REFERENCE_POLICIES.items():
        returns = []
        for seed in seeds:
            observation, _ = env.reset(seed=seed)
            total, done = 0.0, False
            while not done:
                observation, reward, terminated, truncated, _ = env.step(policy(observation))
                total, done = total + float(reward), terminated or truncated
            returns.append(total)
        out[name] = wins(returns) / len(returns) if returns else math.nan
    return out


def wins(returns: Sequence[float]) -> int:
    """Blackjack pays +1 for a win, 0 for a draw, -1 for a loss: a win is a positive return."""
    return sum(1 for r in returns if r > 0)


def mean_ci(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """The mean and its normal-approximation 95 % interval (mean ± z·s/√n; with one value, no width)."""
    from rlfleet.gym.heldout import mean_half_width

    if not values:
        return (math.nan, math.nan, math.nan)
    m, half = mean_half_width(values, z)
    return (m, m - half, m + half)


def rate_ci(successes: int, n: int) -> tuple[float, float, float]:
    """A win rate and its 95 % Wilson interval."""
    from .learning.metrics import wilson

    lo, hi = wilson(successes, n)
    return (successes / n if n else math.nan, lo, hi)


def paired_diff_ci(served: Sequence[float], base: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """The mean of ``served[i] - base[i]`` and its 95 % interval (normal approximation over the pairs).
    Both versions play the same env seeds with the same sampling seeds, so a hand they would play
    alike gives a difference of 0: only the hands where they part add to the spread, and the interval
    is far narrower than two independent rates' (``±1.96·√(0.48/n)`` for Blackjack's win rates)."""
    if len(served) != len(base):
        raise ValueError(f"paired episodes needed: {len(served)} served against {len(base)} base")
    return mean_ci([s - b for s, b in zip(served, base, strict=True)], z)


def curve(returns: Sequence[float], block: int) -> list[dict]:
    """Per block of ``block`` episodes (the last one may be shorter): the episodes it spans, its win
    rate and mean return, each with a 95 % interval."""
    out = []
    for start in range(0, len(returns), block):
        part = returns[start:start + block]
        rate, rlo, rhi = rate_ci(wins(part), len(part))
        mean, mlo, mhi = mean_ci(part)
        out.append({"first": start + 1, "last": start + len(part), "n": len(part), "win_rate": rate,
                    "win_lo": rlo, "win_hi": rhi, "mean_return": mean, "return_lo": mlo, "return_hi": mhi})
    return out


def summarise(side: dict, block: int) -> dict:
    """One side's figures from its child's raw result."""
    returns = side["returns"]
    n = len(returns)
    out = {k: v for k, v in side.items() if k not in ("returns", "turns")}
    out["episodes_per_s"] = n / side["loop_s"] if side["loop_s"] > 0 else math.nan
    out["episodes_per_s_with_load"] = n / (side["loop_s"] + side["load_s"])
    # ours with --background: the loop's rate, and the rate counting the wait for the last runs
    out["episodes_per_s_with_drain"] = n / (side["loop_s"] + side.get("drain_s", 0.0))
    out["turns_per_episode"] = sum(side["turns"]) / n if n else math.nan
    out["win_rate"], out["win_lo"], out["win_hi"] = rate_ci(wins(returns), n)
    out["mean_return"], out["return_lo"], out["return_hi"] = mean_ci(returns)
    out["curve"] = curve(returns, block)
    held = side.get("heldout")
    if held:
        served, base = held["served"], held["base"]
        for name, rets in (("served", served), ("base", base)):
            held[f"{name}_win_rate"], held[f"{name}_win_lo"], held[f"{name}_win_hi"] = rate_ci(wins(rets), len(rets))
            held[f"{name}_mean_return"] = mean_ci(rets)[0]
        won = [[float(r > 0) for r in rets] for rets in (served, base)]
        held["diff"], held["diff_lo"], held["diff_hi"] = paired_diff_ci(*won)
        held["return_diff"], held["return_diff_lo"], held["return_diff_hi"] = paired_diff_ci(served, base)
        held["differing"] = sum(s != b for s, b in zip(served, base, strict=True))
        held["learns"] = held["diff_lo"] > 0
        out["heldout"] = {k: v for k, v in held.items() if k not in ("served", "base")}
    return out


def targets(ours: dict | None, theirs: dict | None) -> dict:
    """Issue 21's three targets: met (True), not met (False) or not measured (None)."""
    held = (ours or {}).get("heldout") or {}
    both = bool(ours and theirs)
    return {
        "learns": held.get("learns"),
        "speed_3x": ours["episodes_per_s_with_drain"] / theirs["episodes_per_s"] >= 3 if both else None,
        "half_memory": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"] <= 0.5 if both else None,
    }


# -- the sides, each in its own process ------------------------------------------------------------


def ours_child(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    import gymnasium as gym

    from rlfleet.gym import Agent

    from .gym_llamagym import BlackjackPrompts, peak_rss_bytes

    class BlackjackAgent(BlackjackPrompts, Agent):
        pass

    kept = contextlib.nullcontext(str(args.home)) if args.home else None
    with kept or tempfile.TemporaryDirectory(prefix="rlfleet-bench-gym-") as home:
        agent = BlackjackAgent(model=args.model, home=home, episodes_per_update=args.per_update, env=ENV,
                               answer_prefix=args.answer_prefix,
                               max_new_tokens=args.max_new_tokens, device="cpu", seed=args.seed,
                               background=args.background)
        try:
            env = gym.make(ENV, natural=False, sab=False)
            loaded = time.perf_counter()
            returns, turns, runs, hits, actions = [], [], [], 0, 0
            act_s = train_s = 0.0
            for episode in range(args.episodes):
                observation, _ = env.reset(seed=args.seed + episode)
                done, total, steps = False, 0.0, 0
                while not done:
                    t = time.perf_counter()
                    action = agent.act(observation)
                    act_s += time.perf_counter() - t
                    hits, actions = hits + (action == 1), actions + 1
                    observation, reward, terminated, truncated, _ = env.step(action)
                    agent.assign_reward(reward)
                    total, steps = total + float(reward), steps + 1
                    done = terminated or truncated
                returns.append(total)
                turns.append(steps)
                t = time.perf_counter()
                stats = agent.terminate_episode()
                train_s += time.perf_counter() - t
                if stats is not None:
                    runs.append(run_row(episode + 1, stats))
                if not args.quiet:
                    print(f"ours: episode {episode + 1}/{args.episodes} return {total:+g}", file=sys.stderr)
            finished = time.perf_counter()
            # background runs still training when the loop ends: waited for, and timed apart
            runs += [run_row(args.episodes, stats) for stats in agent.wait()]
            drained = time.perf_counter()
            # with --background the runs train in the worker process the agent started: its memory counts
            worker_pid = agent.worker_pid
            worker_peak = peak_rss_bytes(worker_pid) if worker_pid is not None else 0
            peak = peak_rss_bytes() + worker_peak
            served = agent.registry.current()
            heldout = None
            if args.heldout:
                seeds = [HELDOUT_SEED + i for i in range(args.heldout)]
                heldout = {"episodes": args.heldout, "version": served}
                for name, version in (("served", served), ("base", None)):
                    with agent.responder.pinned(version):  # CURRENT stays the served one (--home keeps it)
                        played = play_heldout(agent, seeds, args.heldout_batch, args.seed)
                    heldout[name] = played["returns"]
                    heldout[f"{name}_hits"], heldout[f"{name}_turns"] = played["hits"], played["turns"]
                    heldout[f"{name}_hits_by_sum"] = played["by_sum"]
        finally:
            agent.close()
    return {"side": "ours", "episodes": len(returns), "returns": returns, "turns": turns, "hits": hits,
            "actions": actions, "runs": runs, "served": served, "load_s": loaded - started,
            "loop_s": finished - loaded, "drain_s": drained - finished, "act_s": act_s, "close_s": train_s,
            "peak_rss_bytes": peak, "worker_peak_rss_bytes": worker_peak,
            "heldout": heldout, "versions": _versions()}


def play_heldout(agent: Any, seeds: Sequence[int], batch: int, seed: int) -> dict:
    """Play one Blackjack episode per env seed with the agent's served version, ``batch`` episodes in
    lockstep per ``generate`` call (each keeps its own conversation, as ``act`` does: the gate's
    :func:`rlfleet.gym.heldout.play_lockstep`); the returns, and how many of the turns hit. Nothing is
    stored or trained."""
    import gymnasium as gym

    from rlfleet.gym.heldout import play_lockstep

    system = {"role": "system", "content": agent.get_system_prompt()}
    by_sum = {b: [0, 0] for b in SUM_BUCKETS}  # hits, turns

    def count(action: Any, observation: Any) -> None:
        tally = by_sum[sum_bucket(observation[0])]
        tally[0] += action == 1
        tally[1] += 1

    def prompt(conversation: list[dict], observation: Any) -> list[dict]:
        return [*(conversation or [system]), {"role": "user", "content": agent.format_observation(observation)}]

    envs = [gym.make(ENV, natural=False, sab=False) for _ in range(min(batch, len(seeds)))]
    returns = play_lockstep(envs, seeds, agent.respond_many(seed * 7919), prompt, agent.extract_action, max_steps=64,
                            on_action=count)
    return {"returns": returns, "hits": sum(h for h, _ in by_sum.values()),
            "turns": sum(n for _, n in by_sum.values()), "by_sum": by_sum}


def _versions() -> dict:
    from importlib.metadata import version

    out = {}
    for name in ("transformers", "peft", "gymnasium", "torch"):
        with contextlib.suppress(Exception):
            out[name] = version(name)
    return out


def hf_copy(model: str, dest: Path) -> Path:
    """The model's weights and tokenizer as a folder transformers 4.38 (LlamaGym's) loads: rlfleet's
    loader dequantises the GGUF to fp32, ``save_pretrained`` writes it, and three things transformers 5
    writes differently are put back the old way (rope_theta at the config's top level, the chat
    template inside tokenizer_config.json, BPE merges as "a b" strings). Made once; kept in ``dest``."""
    if (dest / "config.json").exists():
        return dest
    from rlfleet.shared.models import load_model, load_tokenizer, resolve_model

    ref = resolve_model(model)
    staging = dest.with_name(dest.name + ".partial")
    load_model(ref).save_pretrained(staging)
    load_tokenizer(ref).save_pretrained(staging)
    cfg = json.loads((staging / "config.json").read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = json.loads((staging / "tokenizer_config.json").read_text())
    for k in ("backend", "is_local", "local_files_only"):
        tok_cfg.pop(k, None)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = staging / "chat_template.jinja"
    if template.exists():
        tok_cfg["chat_template"] = template.read_text()
    (staging / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    tok = json.loads((staging / "tokenizer.json").read_text())
    merges = tok["model"].get("merges") or []
    if merges and isinstance(merges[0], list):
        if any(" " in a or " " in b for a, b in merges):
            raise RuntimeError("a BPE merge holds a space: it cannot be written the old way")
        tok["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    (staging / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    staging.rename(dest)
    return dest


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_side(cmd: list[str], threads: int, quiet: bool) -> tuple[dict | None, str | None]:
    """Run one side's process; its result, or why it failed (the last lines of its stderr)."""
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(threads), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    except OSError as exc:
        return None, f"{cmd[0]} could not start: {exc}"
    err_tail: list[str] = []

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err_tail.append(line.rstrip("\n"))
            del err_tail[:-40]
            if not quiet:
                print(line, end="", file=sys.stderr)

    import threading

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    out = proc.stdout.read() if proc.stdout else ""
    proc.wait()
    t.join()
    lines = [ln for ln in out.strip().splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(ln for ln in err_tail if ln.strip())
        return None, f"exit {proc.returncode}:\n{tail[-3000:]}"
    return json.loads(lines[-1]), None


def run_row(after_episode: int, stats: dict) -> dict:
    return {"after_episode": after_episode, **{k: stats.get(k) for k in (
        "mean_return", "version", "promoted", "loss", "mean_kl", "accepted_seq_frac", "seconds", "skipped")}}


def _forward(args: argparse.Namespace, keys: Sequence[str]) -> list[str]:
    out: list[str] = []
    for k in keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out + (["--quiet"] if args.quiet else [])


# -- the report ------------------------------------------------------------------------------------


def report(fig: dict) -> str:
    ours, theirs = fig.get("ours"), fig.get("llamagym")

    def mib(b: float) -> str:
        return f"{b / 2**20:,.0f} MiB"

    rows = []
    for name, s in (("ours (rlfleet.gym)", ours), ("LlamaGym 0.1.1", theirs)):
        if s:
            rows.append([name, s["episodes"], f"{s['turns_per_episode']:.2f}", f"{s['hits']}/{s['actions']}",
                         f"{s['load_s']:.0f} s",
                         f"{s['loop_s']:.0f} s", f"{s['act_s']:.0f} s", f"{s['close_s']:.0f} s",
                         f"{s['episodes_per_s']:.3f}", mib(s["peak_rss_bytes"]),
                         f"{s['win_rate']:.2f} [{s['win_lo']:.2f}, {s['win_hi']:.2f}]",
                         f"{s['mean_return']:+.2f} [{s['return_lo']:+.2f}, {s['return_hi']:+.2f}]"])
    text = markdown_table(["side", "episodes", "turns/episode", "hits/turns", "load", "loop", "in act",
                           "in terminate_episode", "episodes/s", "peak RSS",
                           "win rate [95 %]", "mean return [95 %]"], rows)
    if ours and theirs:
        text += (f"\n\nours / LlamaGym: {fig['speed_ratio']:.2f}× the episodes/s, "
                 f"{fig['memory_ratio']:.2f}× the peak memory.")
    if theirs and (theirs.get("parts", 1) > 1 or not theirs.get("finished", True)):
        text += (f"\n\nLlamaGym played in {theirs['parts']} part(s) from a saved state "
                 f"({theirs['resume_load_s']:.0f} s of loads after the first, not in its figures)"
                 + ("." if theirs.get("finished", True) else
                    f": {theirs['episodes']} of {theirs['planned']} episodes so far; the same command goes on."))
    if fig.get("answer_prefix"):
        text += (f"\n\nOurs wrote every answer after the prefix {fig['answer_prefix']!r} (`Agent(answer_prefix=)`)"
                 + ("; LlamaGym wrote whole answers, so the speed ratio is not like for like." if theirs else "."))
    for name in SIDES:
        if fig.get(f"{name}_error"):
            who = "LlamaGym" if name == "llamagym" else "ours"
            text += f"\n\n{who} could not run: {fig[name + '_error']}"

    curves = [(n, s["curve"]) for n, s in (("ours", ours), ("LlamaGym", theirs)) if s]
    if curves:
        depth = max(len(c) for _, c in curves)
        body = []
        for b in range(depth):
            first = next(c[b] for _, c in curves if len(c) > b)
            row: list[object] = [f"{first['first']}–{first['last']}"]
            for _, c in curves:
                row.append(f"{c[b]['win_rate']:.2f} [{c[b]['win_lo']:.2f}, {c[b]['win_hi']:.2f}] · "
                           f"{c[b]['mean_return']:+.2f}" if len(c) > b else "–")
            body.append(row)
        text += "\n\nLearning curve (win rate [95 %] · mean return, per block of episodes):\n\n"
        text += markdown_table(["episodes", *[f"{n}" for n, _ in curves]], body)
    for name, s in (("ours", ours), ("LlamaGym", theirs)):
        if s and (s.get("runs") or s.get("batches")):
            updates = s.get("runs") or s.get("batches")
            text += f"\n\n{name}: {len(updates)} training update(s)"
            if name == "ours":
                text += ", promoted: " + ", ".join(
                    f"{u['version']}" + ("" if u.get("promoted") else " (not promoted)") if u.get("version")
                    else "skipped" for u in updates)
    held = (ours or {}).get("heldout")
    if held:
        text += (f"\n\nHeld-out ({held['episodes']} episodes, env seeds {HELDOUT_SEED}+, never trained on): "
                 f"served {held['version'] or 'base'} {held['served_win_rate']:.3f} "
                 f"[{held['served_win_lo']:.3f}, {held['served_win_hi']:.3f}] (mean return "
                 f"{held['served_mean_return']:+.3f}), base {held['base_win_rate']:.3f} "
                 f"[{held['base_win_lo']:.3f}, {held['base_win_hi']:.3f}] ({held['base_mean_return']:+.3f}); "
                 f"difference {held['diff']:+.3f} [{held['diff_lo']:+.3f}, {held['diff_hi']:+.3f}] in win rate, "
                 f"{held['return_diff']:+.3f} [{held['return_diff_lo']:+.3f}, {held['return_diff_hi']:+.3f}] in "
                 f"mean return, paired seed by seed ({held['differing']} of {held['episodes']} hands ended "
                 "apart). Hits: "
                 f"served {held.get('served_hits', '?')} of {held.get('served_turns', '?')} turns, base "
                 f"{held.get('base_hits', '?')} of {held.get('base_turns', '?')}.")
        if held.get("reference"):
            text += " Fixed policies on the same deals: " + ", ".join(
                f"{name} {rate:.3f}" for name, rate in held["reference"].items()) + "."
        if held.get("served_hits_by_sum") and held.get("base_hits_by_sum"):
            text += " Hit rate by the player's sum: " + "; ".join(
                f"{b} served {_share(held['served_hits_by_sum'][b])}, base {_share(held['base_hits_by_sum'][b])}"
                for b in SUM_BUCKETS) + "."
    t = fig["targets"]

    def said(v: bool | None) -> str:
        return "not measured" if v is None else ("met" if v else "not met")

    text += (f"\n\nIssue 21's targets on this run: learns (held-out difference above 0) {said(t['learns'])}; "
             f"≥ 3× LlamaGym's episodes/s {said(t['speed_3x'])}; ≤ ½ its peak memory {said(t['half_memory'])}.")
    return text


def _share(tally: Sequence[int]) -> str:
    hits, turns = tally
    return f"{hits / turns:.2f} ({hits}/{turns})" if turns else "–"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = parser("bench.gym", __doc__)
    ap.add_argument("--episodes", type=int, default=64, help="training episodes per side (default 64)")
    ap.add_argument("--block", type=int, default=16, help="episodes per point of the learning curve (default 16)")
    ap.add_argument("--heldout", type=int, default=200,
                    help="held-out episodes for ours, served version and base each (default 200; 0: none)")
    ap.add_argument("--heldout-batch", type=int, default=32, help="held-out episodes per generate call (default 32)")
    ap.add_argument("--only", choices=SIDES, help="run one side only")
    ap.add_argument("--background", action="store_true",
                    help="ours: train in the background (Agent(background=True)) while the loop keeps playing; "
                         "the wait for the runs still going at the end is reported apart")
    ap.add_argument("--model", default="smollm2-135m", help="alias, local folder or hub id (default smollm2-135m)")
    ap.add_argument("--per-update", type=int, default=16, help="ours: episodes per training run (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="both: answer cap (default 32, LlamaGym's)")
    ap.add_argument("--answer-prefix", default="",
                    help="ours: every answer starts with this text, written for the model (Agent(answer_prefix=), "
                         "e.g. 'Action:'); LlamaGym has no such thing, so its speed ratio is then not like for like "
                         "(default: none)")
    ap.add_argument("--seed", type=int, default=0, help="episode i is dealt with env seed SEED + i (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads per side (default: torch's choice)")
    ap.add_argument("--llamagym-python", default=os.environ.get("LLAMAGYM_PYTHON", LLAMAGYM_PYTHON),
                    help=f"the LlamaGym environment's Python (default $LLAMAGYM_PYTHON or {LLAMAGYM_PYTHON})")
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="where the model's safetensors copy for LlamaGym is kept (default: ~/.cache/rlfleet/bench/)")
    ap.add_argument("--home", type=Path, default=None,
                    help="ours: the agent's data dir, kept after the run (its versions, episodes and ledger, "
                         "for `rlfleet --home DIR history`); it must be new or empty (default: a temporary one)")
    ap.add_argument("--llamagym-state", type=Path, default=None,
                    help="LlamaGym: play in parts, resuming from the state saved in this folder (made if new)")
    ap.add_argument("--llamagym-until", type=float, default=None,
                    help="LlamaGym, with --llamagym-state: save and stop after this many seconds of playing")
    ap.add_argument("--quiet", action="store_true", help="no per-episode progress on stderr")
    output_options(ap)
    ap.add_argument("--child", choices=["ours", "convert"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.block < 1 or args.per_update < 1 or args.heldout < 0 or args.heldout_batch < 1:
        ap.error("--episodes, --block, --per-update and --heldout-batch must be at least 1, --heldout at least 0")
    if args.llamagym_until is not None and args.llamagym_state is None:
        ap.error("--llamagym-until needs --llamagym-state: the episodes played would be lost")
    if args.home and not args.child and args.home.exists() and (not args.home.is_dir() or any(args.home.iterdir())):
        ap.error(f"--home {args.home} is not a new or empty folder: a bench run starts from the base model")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    if args.child == "ours":
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the one JSON line only
            result = ours_child(args)
        print(json.dumps(result))
        return result
    if args.child == "convert":
        with contextlib.redirect_stdout(sys.stderr):
            path = hf_copy(args.model, args.hf_dir)
        print(json.dumps({"path": str(path)}))
        return {"path": str(path)}

    sides = [args.only] if args.only else list(SIDES)
    fig: dict[str, Any] = {"model": args.model, "episodes": args.episodes, "block": args.block, "seed": args.seed,
                           "threads": args.threads, "max_new_tokens": args.max_new_tokens,
                           "per_update": args.per_update, "heldout": args.heldout, "background": args.background,
                           "answer_prefix": args.answer_prefix}
    raw: dict[str, dict] = {}
    if "ours" in sides:
        cmd = [sys.executable, "-m", "bench.gym", "--child", "ours",
               *_forward(args, ("episodes", "heldout", "heldout_batch", "model", "per_update", "max_new_tokens",
                                "answer_prefix",
                                "seed", "threads")), *(["--background"] if args.background else []),
               *(["--home", str(args.home.resolve())] if args.home else [])]
        result, fig["ours_error"] = run_side(cmd, args.threads, args.quiet)
        if result:
            raw["ours"] = result
    if "llamagym" in sides:
        result, fig["llamagym_error"] = run_llamagym(args)
        if result:
            raw["llamagym"] = result
    for name, result in raw.items():
        fig[name] = summarise(result, args.block)
    if (fig.get("ours") or {}).get("heldout"):
        fig["ours"]["heldout"]["reference"] = reference_win_rates([HELDOUT_SEED + i for i in range(args.heldout)])
    ours, theirs = fig.get("ours"), fig.get("llamagym")
    if ours and theirs:
        # every training run finished on both sides: ours counts the wait for its last background runs
        fig["speed_ratio"] = ours["episodes_per_s_with_drain"] / theirs["episodes_per_s"]
        fig["memory_ratio"] = ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]
    fig["targets"] = targets(ours, theirs)
    fig["returns"] = {name: r["returns"] for name, r in raw.items()}
    if fig.get("ours_error") and not raw:
        raise SystemExit(f"ours could not run: {fig['ours_error']}")
    if theirs and not theirs.get("finished", True):
        args.no_record = True  # a run stopped part way is not a result: RESULTS gets the finished one
    publish(fig, report(fig), args, f"`bench.gym` · {args.model} · {args.episodes} episodes · threads "
                                     f"{args.threads or 'default'}")
    return fig


def run_llamagym(args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """The model's safetensors copy (made once, in a process of rlfleet's), then LlamaGym's example on it
    in LlamaGym's environment."""
    python = Path(args.llamagym_python)
    if not python.exists():
        return None, (f"no LlamaGym environment at {python} (build it as bench/gym_llamagym.py says, or pass "
                      "--llamagym-python)")
    from rlfleet.shared.models import model_slug

    hf_dir = args.hf_dir or Path.home() / ".cache" / "rlfleet" / "bench" / f"{model_slug(args.model)}-hf"
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    made, err = run_side([sys.executable, "-m", "bench.gym", "--child", "convert", "--model", args.model,
                          "--hf-dir", str(hf_dir)], args.threads, args.quiet)
    if made is None:
        return None, f"the model's safetensors copy for LlamaGym failed: {err}"
    cmd = [str(python), str(ROOT / "bench" / "gym_llamagym.py"), "--model-dir", made["path"],
           *_forward(args, ("episodes", "seed", "max_new_tokens", "threads"))]
    if args.llamagym_state:
        cmd += ["--state", str(args.llamagym_state.resolve())]
    if args.llamagym_until is not None:
        cmd += ["--until", str(args.llamagym_until)]
    return run_side(cmd, args.threads, args.quiet)


if __name__ == "__main__":
    main()
