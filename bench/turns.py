"""What a multi-turn episode costs per turn with and without the conversation's keys and values kept
between turns (`rlfleet.shared.responder.TurnCache`, what `rlfleet.gym.Agent.act` passes).

An environment agent re-sends the whole episode each turn: the system prompt, every observation and
every answer so far. Without the cache each turn encodes all of it again before it generates; with it,
a turn encodes only the tokens its prompt adds. Both sides answer the same conversations (a text game
of `--turns` turns, its observations a few sentences each) with the same seeds on the same loaded
model, alternating turn by turn so that the machine's noise falls on both; the figure is the ratio of
the seconds per turn, reported per turn index (the gain grows with the episode's length) and overall.
Answers are checked equal between the two sides (same tokens, log-probs within 1e-3).

    python -m bench.turns [--model smollm2-135m] [--episodes 4] [--turns 8] [--new-tokens 16] [--threads N]
                          [--json] [--no-record]
"""

from __future__ import annotations

import statistics
import time

from .record import markdown_table, output_options, parser, publish

SYSTEM = ("You are exploring a house in a text game. Each turn you read what you see and reply with one "
          "command such as 'go north', 'open door' or 'take key'.")
ROOMS = ["a dusty hall with a staircase and a closed door to the north",
         "a kitchen: a cold stove, a table with a brass key on it, a window to the garden",
         "a library, shelves to the ceiling, a ladder, a desk with a locked drawer",
         "a garden with a well, a shed to the east and a gate to the south",
         "a cellar, damp and dark, barrels along the walls and a draught from the west",
         "an attic full of old trunks, one of them open, light from a round window"]


def observation(episode: int, turn: int) -> str:
    room = ROOMS[(episode + turn) % len(ROOMS)]
    return f"Turn {turn + 1}. You are in {room}. You hear footsteps somewhere above you. What do you do?"


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.turns", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--episodes", type=int, default=4, help="conversations played on each side (default 4)")
    ap.add_argument("--turns", type=int, default=8, help="turns per conversation (default 8)")
    ap.add_argument("--new-tokens", type=int, default=16, help="most tokens an answer may have (default 16)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    ap.add_argument("--device", default="auto", help="cpu, cuda, mps or auto (default)")
    output_options(ap)
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.turns < 2 or args.new_tokens < 1:
        ap.error("--episodes and --new-tokens must be at least 1, --turns at least 2")

    import tempfile

    import torch

    from rlfleet.shared.chat_prompt import prompt_ids
    from rlfleet.shared.models import pick_device, resolve_model
    from rlfleet.shared.responder import LocalResponder, TurnCache

    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    responder = LocalResponder(resolve_model(args.model), tempfile.mkdtemp(prefix="bench-turns-"), device=device,
                               max_new_tokens=args.new_tokens, temperature=1.0, top_p=1.0)
    responder.answer([{"role": "user", "content": "warm up"}], seed=0)
    per_turn: dict[str, list[list[float]]] = {"plain": [[] for _ in range(args.turns)],
                                              "cached": [[] for _ in range(args.turns)]}
    prompt_tokens, gap, same = 0, 0.0, 0
    reused = encoded = 0
    for episode in range(args.episodes):
        convo = [{"role": "system", "content": SYSTEM}]
        cache = TurnCache()
        for turn in range(args.turns):
            convo = [*convo, {"role": "user", "content": observation(episode, turn)}]
            seed = 1000 * episode + turn
            order = ("plain", "cached") if (episode + turn) % 2 == 0 else ("cached", "plain")
            got = {}
            for side in order:
                t0 = time.perf_counter()
                got[side] = responder.answer(convo, seed=seed, cache=cache if side == "cached" else None)
                per_turn[side][turn].append(time.perf_counter() - t0)
            a, b = got["plain"], got["cached"]
            same += a.token_ids == b.token_ids
            if a.token_ids == b.token_ids and a.logprobs:
                gap = max(gap, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
            prompt_tokens += len(prompt_ids(responder.tokenizer, convo))
            convo = [*convo, {"role": "assistant", "content": b.text or "look"}]
        reused, encoded = reused + cache.reused, encoded + cache.encoded

    rows, figures_turns = [], []
    for turn in range(args.turns):
        plain, cached = statistics.median(per_turn["plain"][turn]), statistics.median(per_turn["cached"][turn])
        rows.append([turn + 1, f"{plain:.3f}", f"{cached:.3f}", f"{plain / cached:.2f}×"])
        figures_turns.append({"turn": turn + 1, "plain_s": plain, "cached_s": cached})
    total_plain = sum(sum(x) for x in per_turn["plain"])
    total_cached = sum(sum(x) for x in per_turn["cached"])
    answers = args.episodes * args.turns
    figures = {"model": args.model, "device": device, "episodes": args.episodes, "turns": args.turns,
               "new_tokens": args.new_tokens, "per_turn": figures_turns, "plain_s": total_plain,
               "cached_s": total_cached, "speedup": total_plain / total_cached,
               "prompt_tokens": prompt_tokens, "reused_tokens": reused, "encoded_tokens": encoded,
               "same_answers": same, "answers": answers, "max_logprob_gap": gap}
    text = "\n".join([
        markdown_table(["turn", "whole conversation encoded (s, median)", "with the turn cache (s, median)",
                        "ratio"], rows),
        "",
        f"All {answers} turns: {total_plain:.1f} s against {total_cached:.1f} s, "
        f"**{total_plain / total_cached:.2f}×**; "
        f"prompt tokens {prompt_tokens}, of which the cache held {reused} ({reused / max(prompt_tokens, 1):.0%}). "
        f"Same answers on {same} of {answers} turns (log-probs within {gap:.1e} where the same).",
    ])
    publish(figures, text, args, f"`bench.turns` · {args.model} · {device} · {args.episodes} episodes × "
                                 f"{args.turns} turns · {args.new_tokens} new tokens")
    return figures


if __name__ == "__main__":
    main()
