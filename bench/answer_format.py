"""How often an agent's answers keep to the format its environment reads, with and without an answer prefix.

An `rlfleet.gym` agent learns only where its answers carry actions: a model that writes prose which the
parser reads as one fixed action gives a run nothing to tell apart. This draws, exactly as `Agent.act`
draws them (the agent's own responder, sampling settings and `answer_prefix`), answers to the first turn
of Blackjack hands with LlamaGym's example prompts verbatim (bench/gym_llamagym.py), once without a
prefix and once with one, and counts per hand:

- `Action:` anywhere in the answer (the prefix counts: it is part of what the parser reads);
- a readable action: "Action: 0" or "Action: 1" (the shipped example's parser, `Action:\\s*([01])\\b`);
- a hit as LlamaGym's parser reads the answer (prose it cannot read is a stay).

Nothing is stored or trained. Each figure has a Wilson 95 % interval over the answers drawn.

    python -m bench.answer_format [--samples 16] [--sums 8,12,15,20] [--dealer 10] [--prefix Action:]
        [--tokens-without 32] [--tokens-with 4] [--temperature 1.0] [--top-p 1.0] [--json] [--no-record]
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from .gym import rate_ci
from .record import markdown_table, output_options, parser, publish

READABLE = re.compile(r"Action:\s*([01])\b")  # the shipped example's parser (rlfleet.gym.examples.blackjack)


def tally(answers: Sequence[str], llamagym_action: Any) -> dict:
    """The three counts of one hand's answers: ``Action:`` present, a readable 0/1 action, and hits as
    ``llamagym_action`` (LlamaGym's ``extract_action``) reads them."""
    return {
        "answers": len(answers),
        "action_marker": sum("Action:" in a for a in answers),
        "readable": sum(READABLE.search(a) is not None for a in answers),
        "hits": sum(llamagym_action(a) == 1 for a in answers),
    }


def parse_sums(text: str) -> list[int]:
    sums = [int(s) for s in text.split(",") if s.strip()]
    if not sums or any(not 4 <= s <= 21 for s in sums):
        raise ValueError(f"--sums {text!r}: a comma list of player sums from 4 to 21")
    return sums


def main(argv: list[str] | None = None) -> dict:
    ap = parser("bench.answer_format", __doc__)
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or hub id (default: the default model)")
    ap.add_argument("--samples", type=int, default=16, help="answers per hand and variant (default 16)")
    ap.add_argument("--sums", default="8,12,15,20", help="the player's sums, one hand each (default 8,12,15,20)")
    ap.add_argument("--dealer", type=int, default=10, help="the dealer's showing card, 1-10 (default 10)")
    ap.add_argument("--prefix", default="Action:", help='the answer prefix of the second variant (default "Action:")')
    ap.add_argument("--tokens-without", type=int, default=32,
                    help="new tokens an answer may take without the prefix (default 32, as bench.gym)")
    ap.add_argument("--tokens-with", type=int, default=4,
                    help="new tokens after the prefix (default 4, as the shipped example)")
    ap.add_argument("--temperature", type=float, default=1.0, help="default 1.0, the Agent's")
    ap.add_argument("--top-p", type=float, default=1.0, help="default 1.0, the Agent's")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    output_options(ap)
    args = ap.parse_args(argv)
    try:
        sums = parse_sums(args.sums)
    except ValueError as exc:
        ap.error(str(exc))
    if args.samples < 1 or args.tokens_without < 1 or args.tokens_with < 1 or not 1 <= args.dealer <= 10:
        ap.error("--samples, --tokens-without and --tokens-with must be at least 1, --dealer from 1 to 10")
    if not args.prefix.strip():
        ap.error("--prefix must not be blank: the second variant is the one with a prefix")
    if not 0.0 < args.temperature or not 0.0 < args.top_p <= 1.0:
        ap.error("--temperature must be above 0 and --top-p in (0, 1]")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from rlfleet.gym import Agent

    from .gym_llamagym import BlackjackPrompts

    class LlamaGymPrompts(BlackjackPrompts, Agent):
        pass

    hands = [(s, args.dealer, 0) for s in sums]
    variants = [("none", "", args.tokens_without), (args.prefix, args.prefix, args.tokens_with)]
    figures: dict = {"model": args.model, "samples": args.samples, "dealer": args.dealer,
                     "temperature": args.temperature, "top_p": args.top_p, "variants": {}}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-format-") as home:
        for name, prefix, tokens in variants:
            agent = LlamaGymPrompts(model=args.model, home=home, answer_prefix=prefix, max_new_tokens=tokens,
                                    temperature=args.temperature, top_p=args.top_p, device="cpu")
            try:
                started = time.perf_counter()
                system = {"role": "system", "content": agent.get_system_prompt()}
                conversations = [[system, {"role": "user", "content": agent.format_observation(h)}]
                                 for h in hands for _ in range(args.samples)]
                answers = agent.respond_many(args.seed)(conversations, 0)
                per_hand = {}
                for k, hand in enumerate(hands):
                    got = answers[k * args.samples:(k + 1) * args.samples]
                    per_hand[str(hand[0])] = {**tally(got, agent.extract_action), "example": got[0]}
                total = {key: sum(h[key] for h in per_hand.values())
                         for key in ("answers", "action_marker", "readable", "hits")}
                figures["variants"][name] = {
                    "prefix": prefix, "max_new_tokens": tokens, "drawn_by": agent.responder.engine,
                    "by_sum": per_hand, **total, "seconds": time.perf_counter() - started}
            finally:
                agent.close()
            for s, h in [*per_hand.items(), ("all", total)]:
                rows.append([name if s == str(sums[0]) else "", s, h["answers"], *(
                    _share(h[key], h["answers"]) for key in ("action_marker", "readable", "hits"))])
    table = markdown_table(["prefix", "player's sum", "answers", '"Action:" present [95 %]',
                            "readable 0/1 action [95 %]", "hits, LlamaGym's parser [95 %]"], rows)
    text = (f"{table}\n\nLlamaGym's Blackjack prompts verbatim, the dealer showing {args.dealer}, no usable ace; "
            f"temperature {args.temperature:g}, top-p {args.top_p:g}; {args.tokens_without} new tokens without "
            f"the prefix, {args.tokens_with} after it.")
    publish(figures, text, args, f"`bench.answer_format` · {args.model} · {args.samples} answers a hand")
    return figures


def _share(k: int, n: int) -> str:
    rate, lo, hi = rate_ci(k, n)
    return f"{rate:.2f} [{lo:.2f}, {hi:.2f}]"


if __name__ == "__main__":
    main()
